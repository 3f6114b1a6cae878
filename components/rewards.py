"""Sequence-level rewards: rule functions (by name), user functions (`module:function`), a reward model.

A reward function is called by keyword with the fields of the sample it declares, under this project's
names or verl's: `data_source`, `solution_str` (verl) or `response_text` (the same text), `ground_truth`,
`extra_info` (the row's `extra_info` column, a dict, or None); a `**kwargs` parameter receives them all.
So verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and this project's
``fn(response_text, ground_truth, data_source="", extra_info=None)`` both work unchanged. It returns a
number (or verl's ``{"score": number, ...}``).

`reward.function=auto` (the default) routes each sample by its data_source, as verl's default scorer
does: `openai/gsm8k` (and `gsm8k`, and this project's `word_problems`) to `gsm8k`, `answer_only` to
`gsm8k_flexible`, everything else to `exact_match`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from typing import Callable, Literal, Sequence

import torch

from components.settings import Section

RewardFunction = Callable[..., float]
REWARD_FUNCTIONS: dict[str, RewardFunction] = {}
# Responses are decoded with skip_special_tokens=True, but a custom decode path may leave these in.
END_OF_TEXT_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>")
# verl's GSM8K extraction (verl/utils/reward_score/gsm8k.py): the number after the last "#### " ("strict"),
# or the last number ("flexible"), in the last 300 characters of the response.
GSM8K_ANSWER_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM8K_NUMBER_PATTERN = re.compile(r"(\-?[0-9\.\,]+)")
GSM8K_CLIP_CHARS = 300
REWARD_FIELDS = ("data_source", "solution_str", "response_text", "ground_truth", "extra_info")
"""What a reward function may declare (solution_str and response_text are the same text)."""
AUTO = "auto"
DATA_SOURCE_SCORERS = {"openai/gsm8k": "gsm8k", "gsm8k": "gsm8k", "word_problems": "gsm8k",
                       "answer_only": "gsm8k_flexible", "tool_arithmetic": "final_turn_number"}
"""reward.function=auto: data_source -> the registered scorer; any other data_source: exact_match."""


def register_reward_function(name: str) -> Callable[[RewardFunction], RewardFunction]:
    """Decorator adding a function to REWARD_FUNCTIONS under `name`."""

    def decorator(function: RewardFunction) -> RewardFunction:
        REWARD_FUNCTIONS[name] = function
        return function

    return decorator


def strip_end_of_text(text: str) -> str:
    """Cut the text at the first end-of-text marker (anything after it is not the answer) and strip."""
    for marker in END_OF_TEXT_MARKERS:
        text = text.split(marker, 1)[0]
    return text.strip()


@register_reward_function("exact_match")
def exact_match(
    response_text: str, ground_truth: str, data_source: str = "", extra_info: dict | None = None
) -> float:
    """1.0 if the response (whitespace and end marker stripped) equals the stripped ground truth."""
    return 1.0 if strip_end_of_text(response_text) == str(ground_truth).strip() else 0.0


@register_reward_function("gsm8k")
def gsm8k(solution_str: str, ground_truth: str) -> float:
    """verl's strict GSM8K score: 1.0 if the number after the last "#### " in the response's last 300
    characters, commas and "$" removed, equals the ground truth as given, else 0.0."""
    answers = GSM8K_ANSWER_PATTERN.findall(solution_str[-GSM8K_CLIP_CHARS:])
    if not answers:
        return 0.0  # verl's default format_score is 0
    return 1.0 if answers[-1].replace(",", "").replace("$", "") == ground_truth else 0.0


@register_reward_function("gsm8k_flexible")
def gsm8k_flexible(solution_str: str, ground_truth: str) -> float:
    """verl's flexible GSM8K score: the last number of the response's last 300 characters ("" and "."
    skipped), compared with the ground truth as given."""
    for answer in reversed(GSM8K_NUMBER_PATTERN.findall(solution_str[-GSM8K_CLIP_CHARS:])):
        if answer not in ("", "."):
            return 1.0 if answer == ground_truth else 0.0
    return 0.0


@register_reward_function("final_turn_number")
def final_turn_number(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the last number (commas removed) of the policy's last turn equals the ground truth. The last turn is
    the transcript's last assistant message (multi-turn rollouts: extra_info.messages), else the whole response:
    a number a tool answered counts only once the policy writes it."""
    messages = (extra_info or {}).get("messages") if isinstance(extra_info, dict) else None
    turns = [message["content"] for message in messages or [] if message.get("role") == "assistant"]
    text = turns[-1] if turns else solution_str
    numbers = [number for number in GSM8K_NUMBER_PATTERN.findall(text.replace(",", "")) if number not in ("", ".", "-")]
    return 1.0 if numbers and numbers[-1].rstrip(".") == str(ground_truth).strip() else 0.0


def scorer_for(data_source: str) -> str:
    """The registered scorer reward.function=auto uses for a data_source."""
    return DATA_SOURCE_SCORERS.get(data_source, "exact_match")


def auto_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """reward.function=auto: the scorer of the sample's data_source (scorer_for)."""
    return call_reward(REWARD_FUNCTIONS[scorer_for(data_source)], data_source=data_source, solution_str=solution_str,
                       response_text=solution_str, ground_truth=ground_truth, extra_info=extra_info)


def _registered_names() -> str:
    return ", ".join(sorted(REWARD_FUNCTIONS))


def load_reward_function(spec: str, field: str = "reward.function") -> RewardFunction:
    """"auto", a registered name (e.g. "exact_match") or a user function given as "package.module:function";
    its parameters are checked against the fields a reward function receives (REWARD_FIELDS)."""
    if spec == AUTO:
        return auto_reward
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    valid = f"use auto, a registered name ({_registered_names()}) or 'module:function'"
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{field}={spec!r} is not a registered reward function; {valid}")
    module_name, attribute = spec.split(":")
    if not module_name or not attribute:
        raise ValueError(f"{field}={spec!r} has an empty module or function name; {valid}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a user module may fail with anything at import time
        raise ValueError(
            f"{field}={spec!r}: cannot import module {module_name!r} "
            f"({type(error).__name__}: {error}); {valid}"
        ) from error
    function = getattr(module, attribute, None)
    if function is None:
        raise ValueError(
            f"{field}={spec!r}: module {module_name!r} has no attribute {attribute!r}; {valid}"
        )
    if not callable(function):
        raise ValueError(
            f"{field}={spec!r}: {attribute!r} is a {type(function).__name__}, not callable; {valid}"
        )
    _bind(function, field=f"{field}={spec!r}")
    return function


def _bind(function: RewardFunction, field: str = "reward function") -> tuple[list[str], list[str], bool]:
    """(fields passed by position, fields passed by keyword, whether it takes **kwargs) for `function`;
    ValueError when it requires a parameter that is not a reward field."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): every field by keyword
        return [], list(REWARD_FIELDS), True
    positional, keywords, everything = [], [], False
    for parameter in parameters:
        if parameter.kind is parameter.VAR_KEYWORD:
            everything = True
        elif parameter.kind is parameter.VAR_POSITIONAL:
            continue
        elif parameter.name in REWARD_FIELDS:
            (positional if parameter.kind is parameter.POSITIONAL_ONLY else keywords).append(parameter.name)
        elif parameter.default is parameter.empty:
            raise ValueError(
                f"{field}: its parameter {parameter.name!r} is not a field a reward function receives; name its "
                f"parameters after {', '.join(REWARD_FIELDS)} (or take **kwargs); e.g. verl's compute_score("
                "data_source, solution_str, ground_truth, extra_info=None)")
    if everything:
        keywords = [name for name in REWARD_FIELDS if name not in positional]
    return positional, keywords, everything


def call_reward(function: RewardFunction, **fields):
    """Call a reward function with the fields it declares (see the module docstring)."""
    positional, keywords, _ = _bind(function)
    return function(*(fields[name] for name in positional), **{name: fields[name] for name in keywords})


class RewardFunctionError(ValueError):
    """A reward function raised, or returned no finite number, for one sample; `index` is that sample's position
    in the batch scored (None once the error has crossed a process)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


def function_name(function: RewardFunction) -> str:
    """`module:qualname`, as reward.function names a user function."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"


def _as_finite_float(value, index: int, function: RewardFunction) -> float:
    """Coerce one reward to float, rejecting text, NaN and infinities with a pointed message."""
    name = function_name(function)
    # verl lets a reward function return {"score": ..., <extra metrics>}; only the score matters here.
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise RewardFunctionError(
            f"reward function {name} returned {value!r} for sample {index}; it must return a number", index
        )
    number = float(value)
    if not math.isfinite(number):
        raise RewardFunctionError(
            f"reward function {name} returned {number} for sample {index}; rewards must be finite", index
        )
    return number


def score_responses(
    function: RewardFunction,
    response_texts: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str],
    extra_infos: Sequence[dict | None] | None = None,
) -> list[float]:
    """Apply a reward function to every sample, by keyword (see the module docstring); each result must be
    a finite number. RewardFunctionError (one line naming the function and the sample) when the function raises
    or returns anything else."""
    extra_infos = list(extra_infos) if extra_infos is not None else [None] * len(response_texts)
    lengths = {len(response_texts), len(ground_truths), len(data_sources), len(extra_infos)}
    assert len(lengths) == 1, f"score_responses got mismatched lengths {lengths}"
    positional, keywords, _ = _bind(function)
    scores = []
    for index, (response, truth, source, info) in enumerate(
            zip(response_texts, ground_truths, data_sources, extra_infos)):
        fields = {"data_source": source, "solution_str": response, "response_text": response,
                  "ground_truth": truth, "extra_info": info}
        try:
            value = function(*(fields[name] for name in positional), **{name: fields[name] for name in keywords})
        except Exception as error:  # user code may raise anything: name the function and the sample
            detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise RewardFunctionError(
                f"reward function {function_name(function)} raised {type(error).__name__}"
                f"{': ' + detail if detail else ''} on sample {index} (data_source {source!r}); fix the function "
                "(rlhf --debug shows its traceback)", index) from error
        scores.append(_as_finite_float(value, index, function))
    return scores


class RewardModel:
    """A sequence classifier (one logit) scoring prompt + response text, as in RLHF reward modelling."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu") -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        # Right padding: HF's classifier pools the last non-pad token, which this keeps at the text's end.
        self.tokenizer.padding_side = "right"

    @classmethod
    def from_pretrained(
        cls, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> "RewardModel":
        """Load a classifier with num_labels=1 and its tokenizer from a local folder or hub id."""
        # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
        # Without pad_token_id the classifier cannot find each row's last real token in a padded batch.
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        return cls(model, tokenizer, device)

    def score(
        self, prompt_texts: list[str], response_texts: list[str], micro_batch_size: int = 32
    ) -> list[float]:
        """One scalar per (prompt, response) pair, computed in micro-batches without gradients."""
        if len(prompt_texts) != len(response_texts):
            raise ValueError(
                f"RewardModel.score: {len(prompt_texts)} prompts but {len(response_texts)} responses; "
                "pass one response per prompt"
            )
        if micro_batch_size < 1:
            raise ValueError(f"reward_model.micro_batch_size={micro_batch_size} must be >= 1")
        texts = [prompt + response for prompt, response in zip(prompt_texts, response_texts)]
        scores: list[float] = []
        for start in range(0, len(texts), micro_batch_size):
            chunk = texts[start : start + micro_batch_size]
            encoded = self.tokenizer(chunk, padding=True, return_tensors="pt")
            encoded = {name: tensor.to(self.device) for name, tensor in encoded.items()}
            with torch.no_grad():
                logits = self.model(**encoded).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores


# The run's `reward` section (flows/config.py composes it).
class RewardConfig(Section):
    kind: Literal["rule", "model"] = "rule"
    """rule: a scoring function; model: an HF sequence classifier."""
    function: str = "auto"
    """auto (by each sample's data_source, as verl: openai/gsm8k -> gsm8k, others -> exact_match), a rule
    name (exact_match, gsm8k, gsm8k_flexible) or a user's `module:function` (verl's compute_score works)."""
    model_path: str | None = None
    """Reward model folder or hub name when kind is model."""
