"""What a run reads, checked before anything is created (server, MLflow run, run folder) or any model loads.

`check_inputs(config)` checks the torchrun-style environment (RANK < WORLD_SIZE, ...), trainer.device where the
roles run in this process (a CUDA device visible), that run.storage_root and tracking.tracking_uri can be written
(nothing is created), model.path (a model folder whose tokenizer loads and round-trips a short text, and whose
tokenizer's eos is one the model declares; a missing folder the project's commands build is one line naming the
command), the reward function, the prompt files (exist, Parquet, the
columns verl's layout needs, not empty, prompts within data.max_prompt_length per data.overlong_prompts)
and data.prompts_per_step against the prompts there are; a problem is one ValueError line naming the
field, the value and what would be valid. It returns what a run reports at its start: prompt counts,
for reward.function=auto which scorer each data_source gets, and its lineage: the files data.train_files and
data.val_files resolved to (globs expanded; path, size, modification time) and, with model.from_run, the step
of that run's latest committed actor weights it starts from (checked here: none is one line).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import fsspec

from components.data import expand_pattern, load_prompts
from components.models import check_eos, check_model_source, load_tokenizer, resolve_device
from components.placement import check_distributed_env
from components.real_models import REAL_MODELS
from components.rewards import AUTO, load_reward_function, scorer_for
from components.tiny import PRESETS
from flows.config import Config
from flows.runtime.tracking import check_tracking_uri
from storage import RunLayout
from storage.layout import check_storage_root


@dataclass(frozen=True)
class DataFile:
    """One prompt file a run reads, as it was when the run started."""

    path: str
    """Absolute for a local file, else the fsspec URI."""
    size: int | None
    modified: str | None
    """Modification time, ISO 8601 in UTC (None where the filesystem does not say)."""


@dataclass(frozen=True)
class StartingPoint:
    """The policy weights of model.from_run a run starts from."""

    run: str
    step: int
    weights: str


@dataclass
class InputSummary:
    train_prompts: int
    dropped_overlong: int
    val_prompts: int
    scorers: dict[str, str] = field(default_factory=dict)
    """data_source -> the scorer it gets (reward.function=auto), or the one function for all."""
    train_files: list[DataFile] = field(default_factory=list)
    val_files: list[DataFile] = field(default_factory=list)
    from_run: StartingPoint | None = None

    def lineage(self) -> dict:
        """What the run starts from, as run.json and MLflow record it (flows.runtime.tracking.lineage_params)."""
        return {"data": {"train_files": [asdict(entry) for entry in self.train_files],
                         "val_files": [asdict(entry) for entry in self.val_files]},
                "from_run": asdict(self.from_run) if self.from_run else None}

    def lines(self) -> list[str]:
        dropped = f" ({self.dropped_overlong} longer than data.max_prompt_length dropped)" if self.dropped_overlong else ""
        lines = [f"data: {self.train_prompts} training prompts{dropped}, {self.val_prompts} validation prompts"]
        lines += [f"reward: data_source {source!r} scored by {scorer}" for source, scorer in self.scorers.items()]
        return lines


def check_inputs(config: Config, env: Mapping[str, str] | None = None, devices: bool | None = None) -> InputSummary:
    """See the module docstring; raises ValueError with one line. `env` (default os.environ) holds the
    torchrun-style variables checked (components.placement.check_distributed_env); `devices` says whether the
    roles run on this machine, so that trainer.device is checked here (default: under trainer.execution=local,
    every role in this process; `rlhf run` passes True, `rlhf submit` False: the worker's machine is not this one)."""
    if errors := check_distributed_env(os.environ if env is None else env):
        raise ValueError("; ".join(errors))
    if config.trainer.execution == "local" if devices is None else devices:
        check_device(config)
    check_storage_root(config.run.storage_root)
    check_tracking_uri(config.tracking.tracking_uri)
    # With model.from_run the policy's weights come from that run; model.path still gives the tokenizer.
    check_model_folder(config.model.path, needs_config=not config.model.from_run)
    if config.critic.model_path and config.uses_critic:
        check_model_folder(config.critic.model_path, field="critic.model_path", needs_config=True)
    start = starting_point(config)
    if config.reward.kind == "rule":
        load_reward_function(config.reward.function)
    else:
        check_model_folder(config.reward.model_path, field="reward.model_path", needs_config=True)
    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code, check=True)
    check_eos(tokenizer, config.model.path, trust_remote_code=config.model.trust_remote_code)
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
    return InputSummary(len(train), dropped, len(val), scorers, data_files(data.train_files, "data.train_files"),
                        data_files(data.val_files, "data.val_files"), start)


def check_device(config: Config) -> None:
    """trainer.device is one this machine has (`cuda` needs a visible CUDA device); ValueError with one line."""
    resolve_device(config.trainer.device)


def model_build_command(path: str) -> str | None:
    """The command of this project that writes the model folder `path` names, from its folder name (the configs'
    convention): `<preset>-shaped` a tiny model of that shape, `tiny-qwen2` the quickstart's, a real model's name
    (components.real_models) that model; None for any other name."""
    name = Path(path).name
    if name == "tiny-qwen2":
        return f"rlhf make-tiny-model {path}"
    if name.endswith("-shaped") and name.removesuffix("-shaped") in PRESETS:
        return f"rlhf make-tiny-model {path} --preset {name.removesuffix('-shaped')}"
    if name in REAL_MODELS:
        return f"rlhf make-model {name} {path}"
    return None


def check_model_folder(path: str, field: str = "model.path", needs_config: bool = False) -> None:
    """components.models.check_model_source, and a missing folder that a command of this project writes
    names that command (`rlhf make-tiny-model .rlhf/models/qwen2.5-0.5b-shaped --preset qwen2.5-0.5b`)."""
    looks_local = path.startswith((".", "/", "~")) or Path(path).exists()
    command = model_build_command(path) if looks_local and not Path(path).expanduser().exists() else None
    if command:
        raise ValueError(f"{field}={path!r} does not exist; build it with `{command}`, or give another local model "
                         "folder or a Hugging Face hub name")
    check_model_source(path, field, needs_config=needs_config)


def data_files(paths: list[str], field: str) -> list[DataFile]:
    """The files `paths` name, globs expanded as components.data reads them, each with its size and
    modification time."""
    resolved = []
    for path in (match for pattern in paths for match in expand_pattern(str(pattern), field)):
        fs, inner = fsspec.core.url_to_fs(path)
        local = "://" not in path
        info = fs.info(inner)
        try:
            modified = fs.modified(inner).isoformat()
        except (NotImplementedError, OSError, AttributeError):
            modified = None
        resolved.append(DataFile(os.path.abspath(inner) if local else path, info.get("size"), modified))
    return resolved


def starting_point(config: Config) -> StartingPoint | None:
    """The latest committed actor weights of model.from_run when RL starts from them (no warm-start, which
    starts from model.path); ValueError when that run has none."""
    run = config.model.from_run
    if not run or config.warm_start.steps > 0:
        return None
    layout = RunLayout(config.run.storage_root, run)
    latest = layout.latest_weights("actor")
    if latest is None:
        raise ValueError(f"model.from_run={run!r}: that run has no committed actor weights under "
                         f"{config.run.storage_root}; give a run that has trained at least one step, or unset it")
    step, weights = latest
    return StartingPoint(run, step, layout.fs.unstrip_protocol(weights) if "://" in layout.root else weights)
