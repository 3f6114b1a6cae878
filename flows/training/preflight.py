"""What a run reads, checked before anything is created (server, MLflow run, run folder) or any model loads.

`check_inputs(config)` checks model.path, the reward function, the prompt files (exist, Parquet, the
columns verl's layout needs, not empty, prompts within data.max_prompt_length per data.overlong_prompts)
and data.prompts_per_step against the prompts there are; a problem is one ValueError line naming the
field, the value and what would be valid. It returns what a run reports at its start: prompt counts and,
for reward.function=auto, which scorer each data_source gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from components.data import load_prompts
from components.models import check_model_source, load_tokenizer
from components.rewards import AUTO, load_reward_function, scorer_for
from flows.config import Config


@dataclass
class InputSummary:
    train_prompts: int
    dropped_overlong: int
    val_prompts: int
    scorers: dict[str, str] = field(default_factory=dict)
    """data_source -> the scorer it gets (reward.function=auto), or the one function for all."""

    def lines(self) -> list[str]:
        dropped = f" ({self.dropped_overlong} longer than data.max_prompt_length dropped)" if self.dropped_overlong else ""
        lines = [f"data: {self.train_prompts} training prompts{dropped}, {self.val_prompts} validation prompts"]
        lines += [f"reward: data_source {source!r} scored by {scorer}" for source, scorer in self.scorers.items()]
        return lines


def check_inputs(config: Config) -> InputSummary:
    """See the module docstring; raises ValueError with one line."""
    check_model_source(config.model.path)
    if config.reward.kind == "rule":
        load_reward_function(config.reward.function)
    else:
        check_model_source(config.reward.model_path, field="reward.model_path")
    try:
        tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"model.path={config.model.path!r}: its tokenizer does not load ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}); give a model folder with tokenizer "
                         "files or a hub name") from error
    data = config.data
    train, dropped = load_prompts(data.train_files, tokenizer, max_prompt_length=data.max_prompt_length,
                                  overlong=data.overlong_prompts, field="data.train_files", target=config.warm_start.target)
    val, _ = load_prompts(data.val_files, tokenizer, max_prompt_length=data.max_prompt_length,
                          overlong=data.overlong_prompts, field="data.val_files")
    if data.prompts_per_step > len(train):
        raise ValueError(f"data.prompts_per_step={data.prompts_per_step}: data.train_files hold {len(train)} usable "
                         f"prompts; use at most {len(train)}")
    if config.reward.kind == "model":
        scorers = {}
    else:
        sources = sorted({record.data_source for record in train + val})
        scorers = {source: scorer_for(source) if config.reward.function == AUTO else config.reward.function
                   for source in sources}
    return InputSummary(len(train), dropped, len(val), scorers)
