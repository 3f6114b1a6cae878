"""Prompt loading from verl-format Parquet files, and a resumable, deterministic prompt order.

A verl row has `prompt` (a list of {role, content} chat messages, or here also a plain string),
`reward_model.ground_truth` and optionally `data_source` and `extra_info` (a struct, passed on to the
reward function as a dict, as verl does). Prompts are rendered with the tokenizer's
chat template, tokenized once, and checked against `data.max_prompt_length`: an overlong prompt is
filtered or rejected, never truncated (a truncated question has a different answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Sequence

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from pydantic import Field, field_validator

from components.settings import Section
from storage.schema import is_message_list

DEFAULT_DATA_SOURCE = "unknown"
OVERLONG_POLICIES = ("filter", "error")
# Columns of the normalized table returned by `read_prompt_table`.
NORMALIZED_COLUMNS = ("messages", "raw_prompt", "ground_truth", "data_source", "extra_info", "source_file",
                      "source_row")
WARM_START_TARGETS = "auto, ground_truth or extra_info.<key>"


@dataclass(frozen=True)
class PromptRecord:
    """One tokenized prompt. `index` is its position in the list `load_prompts` returns."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    data_source: str
    # What supervised warm-start trains towards (warm_start.target): a worked answer or the ground truth, or a
    # multi-turn demonstration: assistant and tool messages, the tools' answers attended to but not trained on.
    target_text: str | tuple[dict, ...] | None
    extra_info: str = "null"
    """The row's extra_info as JSON text ("null" when the file has none); the reward function gets it decoded."""


def _open_parquet(path: str, field: str) -> pa.Table:
    """Read one Parquet file from a local path or any fsspec URI."""
    filesystem, path_in_filesystem = fsspec.core.url_to_fs(path)
    if not filesystem.exists(path_in_filesystem):
        raise ValueError(
            f"{field}: file {path!r} does not exist; give existing Parquet files (paths or fsspec URIs)"
        )
    try:
        table = pq.read_table(path_in_filesystem, filesystem=filesystem)
    except (pa.ArrowInvalid, OSError) as error:
        detail = str(error).replace(f"Could not open Parquet input source '{path_in_filesystem}': ", "")
        raise ValueError(f"{field}: file {path!r} is not a readable Parquet file ({detail})") from error
    for name, column in zip(table.column_names, table.columns):
        try:
            column.validate(full=True)  # text that is not UTF-8 would fail later, naming no file
        except pa.ArrowInvalid as error:
            detail = str(error).splitlines()[0]
            problem, fix = (("holds text that is not UTF-8", "write the file again with UTF-8 text") if "UTF8" in detail
                            else ("does not validate", "write the file again"))
            raise ValueError(f"{field}: file {path!r} column {name!r} {problem} ({detail}); {fix}") from error
    return table


def _normalize_table(table: pa.Table, path: str, field: str) -> pa.Table:
    """Map one file's verl columns onto NORMALIZED_COLUMNS, validating types on the way."""
    columns = set(table.column_names)
    for required in ("prompt", "reward_model"):
        if required not in columns:
            raise ValueError(
                f"{field}: file {path!r} has no {required!r} column (has {sorted(columns)}); "
                "verl rows need prompt and reward_model"
            )
    prompt_type = table.schema.field("prompt").type
    plain_string = pa.types.is_string(prompt_type) or pa.types.is_large_string(prompt_type)
    if not plain_string and not is_message_list(prompt_type):
        raise ValueError(
            f"{field}: file {path!r} column 'prompt' has type {prompt_type}; "
            "expected a string or a list of {role, content} structs"
        )
    reward_type = table.schema.field("reward_model").type
    if not pa.types.is_struct(reward_type) or reward_type.get_field_index("ground_truth") < 0:
        raise ValueError(
            f"{field}: file {path!r} column 'reward_model' has type {reward_type}; "
            "expected a struct with a 'ground_truth' field"
        )
    ground_truth = pc.struct_field(table.column("reward_model"), "ground_truth")
    try:
        ground_truth = pc.cast(ground_truth, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise ValueError(
            f"{field}: file {path!r} reward_model.ground_truth has type {ground_truth.type}; "
            "expected text or a number"
        ) from error
    if "data_source" in columns:
        data_source = pc.fill_null(pc.cast(table.column("data_source"), pa.string()), DEFAULT_DATA_SOURCE)
    else:
        data_source = pa.array([DEFAULT_DATA_SOURCE] * table.num_rows, pa.string())
    messages_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    prompt = table.column("prompt")
    extra_info = pa.array([json.dumps(value, default=str) for value in (
        table.column("extra_info").to_pylist() if "extra_info" in columns else [None] * table.num_rows)], pa.string())
    return pa.table({
        "messages": pa.nulls(table.num_rows, messages_type) if plain_string
        else pc.cast(prompt, messages_type),
        "raw_prompt": pc.cast(prompt, pa.string()) if plain_string else pa.nulls(table.num_rows, pa.string()),
        "ground_truth": ground_truth,
        "data_source": data_source,
        "extra_info": extra_info,
        "source_file": pa.array([path] * table.num_rows, pa.string()),
        "source_row": pa.array(range(table.num_rows), pa.int64()),
    })


def read_prompt_table(paths: Sequence[str] | str, field: str = "data.train_files") -> pa.Table:
    """Read and concatenate verl-format Parquet files into one table of NORMALIZED_COLUMNS.

    `messages` holds chat prompts and `raw_prompt` plain-string prompts (the other is null);
    `source_file`/`source_row` locate each row for error messages.
    """
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError(f"{field}: no files given; list one or more Parquet files")
    paths = [match for path in paths for match in expand_pattern(str(path), field)]
    tables = [_normalize_table(_open_parquet(path, field), path, field) for path in paths]
    return pa.concat_tables(tables)


def expand_pattern(path: str, field: str) -> list[str]:
    """A path with `*`, `?` or `[` is a glob (local or fsspec URI): its matches, sorted, or an error."""
    if not any(character in path for character in "*?["):
        return [path]
    fs, pattern = fsspec.core.url_to_fs(path)
    protocol = path.split("://", 1)[0] + "://" if "://" in path else ""
    matches = sorted(fs.glob(pattern))
    if not matches:
        raise ValueError(f"{field}: the pattern {path!r} matches no file")
    return [protocol + match if protocol else match for match in matches]


def render_prompt(tokenizer, messages: list[dict] | str) -> str:
    """Chat messages -> prompt text via the chat template (or newline-joined contents without one).

    A plain string is a pre-rendered prompt and is returned unchanged.
    """
    if isinstance(messages, str):
        return messages
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(message.get("content") or "" for message in messages)


def _overlong_message(field: str, row: dict, length: int, max_prompt_length: int) -> str:
    return (
        f"{field}: prompt at row {row['source_row']} of {row['source_file']!r} is {length} tokens, "
        f"over data.max_prompt_length={max_prompt_length}; "
        "raise data.max_prompt_length or set data.overlong_prompts=filter"
    )


def load_prompts(
    paths: Sequence[str] | str,
    tokenizer,
    *,
    max_prompt_length: int,
    overlong: Literal["filter", "error"] = "filter",
    field: str = "data.train_files",
    target: str = "auto",
) -> tuple[list[PromptRecord], int]:
    """Render, tokenize and length-check every prompt; return (records, number filtered as overlong).

    `target` (warm_start.target) picks each record's target_text: `extra_info.<key>`, `ground_truth`, or
    auto: extra_info.answer where the row has one (verl's GSM8K rows: the worked answer ending in
    `#### n`, the format the gsm8k scorer expects), else the ground truth."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(
            f"data.overlong_prompts={overlong!r} is not valid; use one of {list(OVERLONG_POLICIES)}"
        )
    if max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length={max_prompt_length} must be >= 1")
    if target not in ("auto", "ground_truth") and not target.startswith("extra_info."):
        raise ValueError(f"warm_start.target={target!r} is not valid; use {WARM_START_TARGETS}")
    rows = read_prompt_table(paths, field).to_pylist()
    if not rows:
        raise ValueError(f"{field}: the files hold no rows ({', '.join(map(str, [paths] if isinstance(paths, str) else paths))})")
    texts = [
        render_prompt(tokenizer, row["raw_prompt"] if row["messages"] is None else row["messages"])
        for row in rows
    ]
    # One batched call: fast tokenizers parallelize it, and it is the only tokenization of the prompts.
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    records: list[PromptRecord] = []
    filtered = 0
    for row, text, prompt_ids in zip(rows, texts, all_ids):
        if not prompt_ids:
            raise ValueError(
                f"{field}: prompt at row {row['source_row']} of {row['source_file']!r} is empty "
                "(0 tokens); remove it from the data"
            )
        if len(prompt_ids) > max_prompt_length:
            if overlong == "error":
                raise ValueError(_overlong_message(field, row, len(prompt_ids), max_prompt_length))
            filtered += 1
            continue
        records.append(PromptRecord(
            index=len(records),
            prompt_ids=list(prompt_ids),
            prompt_text=text,
            ground_truth=row["ground_truth"] or "",
            data_source=row["data_source"],
            target_text=_target_text(row, target, field),
            extra_info=row["extra_info"],
        ))
    if not records:
        raise ValueError(
            f"{field}: all {len(rows)} prompts are longer than data.max_prompt_length={max_prompt_length} "
            "tokens; raise data.max_prompt_length"
        )
    return records, filtered


def _target_text(row: dict, target: str, field: str) -> str | None:
    if target == "ground_truth":
        return row["ground_truth"]
    extra = json.loads(row["extra_info"])
    key = "answer" if target == "auto" else target.removeprefix("extra_info.")
    value = extra.get(key) if isinstance(extra, dict) else None
    if value is None:
        if target == "auto":
            return row["ground_truth"]
        raise ValueError(f"warm_start.target={target!r}: row {row['source_row']} of {row['source_file']!r} has no "
                         f"extra_info.{key}; use {WARM_START_TARGETS}")
    if isinstance(value, list):
        return _demonstration(value, row, target)
    return str(value)


def _demonstration(messages: list, row: dict, target: str) -> tuple[dict, ...]:
    """A warm-start target that is a conversation: [{"role": "assistant"|"tool", "content": str}, ...], ending with
    the policy's own turn (as a multi-turn rollout's response does)."""
    where = f"warm_start.target={target!r}: row {row['source_row']} of {row['source_file']!r}"
    for position, message in enumerate(messages):
        if (not isinstance(message, dict) or message.get("role") not in ("assistant", "tool")
                or not isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {position} is {message!r}; a demonstration is a list of "
                             '{"role": "assistant" or "tool", "content": text}')
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: a demonstration must end with an assistant message (the policy's last turn)")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


class PromptSampler:
    """Which prompts each training step uses, as a pure function of the step number.

    Epoch `e` is a permutation of range(num_prompts) seeded with `seed + e`; the epochs are laid end
    to end and step `k` takes positions [k*batch_size, (k+1)*batch_size), so a batch may straddle two
    epochs. With no mutable cursor, a run resumed at step k sees exactly the batches it would have.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError(
                f"data: num_prompts={num_prompts} must be >= 1 (the prompt files hold no usable rows)"
            )
        if batch_size < 1 or batch_size > num_prompts:
            raise ValueError(
                f"data.prompts_per_step={batch_size} must be between 1 and the number of prompts "
                f"({num_prompts})"
            )
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._permutations: dict[int, list[int]] = {}  # a cache only: values depend on epoch alone

    def epoch_permutation(self, epoch: int) -> list[int]:
        """The prompt order of one epoch."""
        if epoch not in self._permutations:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_prompts, generator=generator).tolist()
            else:
                order = list(range(self.num_prompts))
            self._permutations = {epoch: order}  # only the current epoch is needed going forward
            return order
        return self._permutations[epoch]

    def batch_indices(self, step: int) -> list[int]:
        """Prompt indices for training step `step` (0-based)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        start = step * self.batch_size
        indices = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, self.num_prompts)
            indices.append(self.epoch_permutation(epoch)[offset])
        return indices

    def epoch_of(self, step: int) -> int:
        """The epoch that the first prompt of step `step` belongs to."""
        return (step * self.batch_size) // self.num_prompts

    def state_dict(self) -> dict:
        """Everything that determines the order (the step number itself lives in the checkpoint)."""
        return {
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }


# The run's `data` section (flows/config.py composes it).
class DataConfig(Section):
    train_files: list[str] = [".rlhf/data/arithmetic/train.parquet"]
    """verl-format Parquet prompt files for training (one path or a list); glob patterns
    (`prompts/2026-*.parquet`) allowed."""
    val_files: list[str] = [".rlhf/data/arithmetic/validation.parquet"]
    """verl-format Parquet prompt files for validation (one path or a list)."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value
    max_prompt_length: int = Field(64, gt=0)
    """Longest prompt in tokens, after the chat template."""
    overlong_prompts: Literal["filter", "error"] = "filter"
    """What to do with a longer prompt: drop it (counted in the log) or stop with an error."""
    prompts_per_step: int = Field(32, gt=0)
    """Prompts drawn per training step (each sampled rollout.n times)."""
    max_val_prompts: int | None = Field(None, gt=0)
    """Validate on at most this many prompts (None: all)."""
    shuffle: bool = True
    """Reshuffle the training prompts each epoch (seeded by trainer.seed)."""
