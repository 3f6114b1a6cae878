"""The batch schema, declared once.

Every role (rollout, reward, reference, critic, actor, driver, validation)
exchanges per-step data as Parquet files whose columns are declared here.
Writers and readers both go through these declarations, so a column's type
and meaning cannot drift between the process that produces it and the ones
that consume it.

Shape letters: B = samples in the batch, P = prompt tokens, T = response
tokens. Token ids are list<int32>; per-token floats are list<float32> and
per-token flags list<int8>, always aligned with `response_ids` (one value per
response token).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

ROLES: tuple[str, ...] = (
    "rollout", "reward", "reference", "critic", "actor", "driver", "validation",
)

TOKEN_IDS = pa.list_(pa.int32())
TOKEN_FLOATS = pa.list_(pa.float32())
TOKEN_FLAGS = pa.list_(pa.int8())


@dataclass(frozen=True)
class Column:
    name: str
    arrow_type: pa.DataType
    shape: str
    writer: str
    readers: tuple[str, ...]
    doc: str


@dataclass(frozen=True)
class StageSchema:
    name: str
    columns: tuple[str, ...]
    doc: str

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(name, COLUMNS[name].arrow_type) for name in self.columns])


def _column(name, arrow_type, shape, writer, readers, doc) -> tuple[str, Column]:
    return name, Column(name, arrow_type, shape, writer, tuple(readers), doc)


COLUMNS: dict[str, Column] = dict([
    _column("uid", pa.string(), "[B]", "rollout", ROLES,
            "Unique sample id; every stage file is aligned to the rollout by it."),
    _column("group_id", pa.string(), "[B]", "rollout", ("driver",),
            "Samples generated from one prompt share it (GRPO groups)."),
    _column("prompt_ids", TOKEN_IDS, "[B, P]", "rollout",
            ("reward", "reference", "critic", "actor"),
            "Prompt token ids (chat template applied), unpadded."),
    _column("response_ids", TOKEN_IDS, "[B, T]", "rollout", ROLES,
            "Sampled response token ids, unpadded; defines T for every per-token column."),
    _column("rollout_logprobs", TOKEN_FLOATS, "[B, T]", "rollout", ("driver",),
            "Log-probs of the sampled tokens under the sampling distribution; NaN on the samples the "
            "engine was not asked for (rollout.logprobs_fraction)."),
    _column("loss_mask", TOKEN_FLAGS, "[B, T]", "rollout", ("reference", "critic", "actor", "driver"),
            "1 on the response tokens the policy generated, 0 on those a tool's answer added (multi-turn "
            "rollouts, rollout.max_turns); only the 1s are trained on and counted in advantages and metrics."),
    _column("response_text", pa.string(), "[B]", "rollout", ("reward",),
            "Detokenized response."),
    _column("ground_truth", pa.string(), "[B]", "rollout", ("reward",),
            "Copied from the prompt's reward_model.ground_truth."),
    _column("data_source", pa.string(), "[B]", "rollout", ("reward",),
            "Dataset name; selects the reward function."),
    _column("extra_info", pa.string(), "[B]", "rollout", ("reward",),
            "The prompt row's extra_info as JSON text ('null' when the file has none); the reward function "
            "receives it decoded (a dict, or None)."),
    _column("finish_reason", pa.string(), "[B]", "rollout", ("driver",),
            "'stop' (EOS/stop string) or 'length' (hit max response tokens)."),
    _column("score", pa.float32(), "[B]", "reward", ("driver",),
            "Sequence-level reward."),
    _column("ref_logprobs", TOKEN_FLOATS, "[B, T]", "reference", ("driver",),
            "Log-probs of the response tokens under the frozen reference policy."),
    _column("values", TOKEN_FLOATS, "[B, T]", "critic", ("driver", "critic"),
            "Critic value estimates per response token."),
    _column("old_logprobs", TOKEN_FLOATS, "[B, T]", "actor", ("driver", "actor"),
            "Log-probs under the actor weights that generated the batch (PPO ratio denominator)."),
    _column("token_rewards", TOKEN_FLOATS, "[B, T]", "driver", ("driver",),
            "Per-token rewards after KL shaping (kept for metrics)."),
    _column("advantages", TOKEN_FLOATS, "[B, T]", "driver", ("actor",),
            "Per-token advantages (GAE or GRPO group-normalized)."),
    _column("returns", TOKEN_FLOATS, "[B, T]", "driver", ("critic",),
            "Per-token value targets for the critic."),
    _column("prompt_text", pa.string(), "[B]", "validation", ("driver",),
            "Rendered prompt, kept so validation generations can be inspected."),
])


STAGES: dict[str, StageSchema] = {
    stage.name: stage
    for stage in (
        StageSchema("rollout", (
            "uid", "group_id", "prompt_ids", "response_ids", "rollout_logprobs", "loss_mask",
            "response_text", "ground_truth", "data_source", "extra_info", "finish_reason",
        ), "Generated samples; the batch every later stage is aligned to."),
        StageSchema("reward", ("uid", "score"), "Sequence-level rewards."),
        StageSchema("reference", ("uid", "ref_logprobs"), "Reference-policy log-probs."),
        StageSchema("values", ("uid", "values"), "Critic values before the update."),
        StageSchema("old_logprobs", ("uid", "old_logprobs"), "Actor log-probs before the update."),
        StageSchema("advantages", ("uid", "token_rewards", "advantages", "returns"),
                    "Driver-computed training targets."),
        StageSchema("validation", (
            "uid", "prompt_text", "response_text", "ground_truth", "data_source", "extra_info", "score",
        ), "Greedy/eval generations on the validation set, with their scores."),
    )
}


def get_stage(name: str) -> StageSchema:
    """Return a stage's schema, or fail with the list of valid names."""
    if name not in STAGES:
        raise ValueError(
            f"unknown stage {name!r}; valid stages: {', '.join(sorted(STAGES))}"
        )
    return STAGES[name]


def _check_declarations() -> None:
    # Internal invariants of the tables above; a failure is a bug in this file.
    for column in COLUMNS.values():
        assert column.writer in ROLES, column
        assert all(reader in ROLES for reader in column.readers), column
    for stage in STAGES.values():
        assert stage.columns[0] == "uid", stage
        assert all(name in COLUMNS for name in stage.columns), stage


_check_declarations()


# ---------------------------------------------------------------------------
# Prompt input files (verl's format)
# ---------------------------------------------------------------------------

class PromptSchemaError(ValueError):
    """A prompts file does not follow verl's prompt format."""


@dataclass(frozen=True)
class PromptColumn:
    name: str
    required: bool
    expected: str  # human-readable description of the accepted arrow type
    doc: str


PROMPT_COLUMNS: dict[str, PromptColumn] = {
    column.name: column
    for column in (
        PromptColumn("data_source", False, "string",
                     "Dataset name; selects the reward function (loader fills a default)."),
        PromptColumn("prompt", True, "list<struct<role: string, content: string>>",
                     "Chat messages to render with the tokenizer's chat template."),
        PromptColumn("ability", False, "string", "Free-form task category."),
        PromptColumn("reward_model", True, "struct<ground_truth: string, ...>",
                     "Reward spec; only ground_truth is required."),
        PromptColumn("extra_info", False, "any", "Passed through untouched."),
    )
}


def _is_string(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def is_message_list(arrow_type: pa.DataType) -> bool:
    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    item = arrow_type.value_type
    if not pa.types.is_struct(item):
        return False
    fields = {item.field(index).name: item.field(index).type for index in range(item.num_fields)}
    return all(name in fields and _is_string(fields[name]) for name in ("role", "content"))


def _has_string_ground_truth(arrow_type: pa.DataType) -> bool:
    if not pa.types.is_struct(arrow_type):
        return False
    index = arrow_type.get_field_index("ground_truth")
    return index >= 0 and _is_string(arrow_type.field(index).type)


def validate_prompts_table(table: pa.Table, source: str) -> None:
    """Raise PromptSchemaError (naming `source`) if required prompt columns are wrong.

    Optional columns (data_source, ability) are only type-checked when present;
    defaults for missing ones are the loader's job.
    """
    names = set(table.column_names)
    for required in ("prompt", "reward_model"):
        if required not in names:
            raise PromptSchemaError(
                f"{source}: missing required column {required!r} "
                f"(expected {PROMPT_COLUMNS[required].expected}); found {sorted(names)}"
            )
    checks = {
        "prompt": is_message_list,
        "reward_model": _has_string_ground_truth,
        "data_source": _is_string,
        "ability": _is_string,
    }
    for name, is_valid in checks.items():
        if name in names and not is_valid(table.schema.field(name).type):
            raise PromptSchemaError(
                f"{source}: column {name!r} has type {table.schema.field(name).type}, "
                f"expected {PROMPT_COLUMNS[name].expected}"
            )
    for name in ("prompt", "reward_model"):
        if table.column(name).null_count:
            raise PromptSchemaError(
                f"{source}: column {name!r} has {table.column(name).null_count} null rows; "
                "every prompt needs messages and a reward_model"
            )
    ground_truth = pa.chunked_array(
        [chunk.field("ground_truth") for chunk in table.column("reward_model").chunks],
        type=table.schema.field("reward_model").type.field("ground_truth").type,
    )
    if ground_truth.null_count:
        raise PromptSchemaError(
            f"{source}: reward_model.ground_truth is null in {ground_truth.null_count} rows; "
            "every prompt needs a ground truth string"
        )


# ---------------------------------------------------------------------------
# Documentation
# ---------------------------------------------------------------------------

def type_name(arrow_type: pa.DataType) -> str:
    """Short type spelling (list<int32> rather than list<item: int32>)."""
    if pa.types.is_list(arrow_type):
        return f"list<{type_name(arrow_type.value_type)}>"
    if pa.types.is_floating(arrow_type):
        return f"float{arrow_type.bit_width}"  # arrow prints float32 as "float"
    return str(arrow_type)


def describe_schema() -> str:
    """Markdown tables of every column and of the columns each stage file holds."""
    lines = [
        "| column | type | shape | writer | readers | doc |",
        "|---|---|---|---|---|---|",
    ]
    for column in COLUMNS.values():
        readers = "all" if set(column.readers) == set(ROLES) else ", ".join(column.readers)
        lines.append(
            f"| `{column.name}` | `{type_name(column.arrow_type)}` | {column.shape} "
            f"| {column.writer} | {readers} | {column.doc} |"
        )
    lines += ["", "| stage file | columns | doc |", "|---|---|---|"]
    for stage in STAGES.values():
        columns = ", ".join(f"`{name}`" for name in stage.columns)
        lines.append(f"| `{stage.name}.parquet` | {columns} | {stage.doc} |")
    return "\n".join(lines) + "\n"
