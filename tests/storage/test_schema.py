import pyarrow as pa
import pytest

from storage.schema import (
    COLUMNS, ROLES, STAGES, PromptSchemaError, describe_schema, get_stage,
    validate_prompts_table,
)


def test_stage_arrow_schema_has_declared_types_in_order():
    schema = STAGES["rollout"].arrow_schema()
    assert schema.names == [
        "uid", "group_id", "prompt_ids", "response_ids", "rollout_logprobs", "loss_mask",
        "response_text", "ground_truth", "data_source", "extra_info", "finish_reason",
    ]
    assert schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert schema.field("loss_mask").type == pa.list_(pa.int8())
    assert schema.field("rollout_logprobs").type == pa.list_(pa.float32())
    assert STAGES["reward"].arrow_schema().field("score").type == pa.float32()
    assert STAGES["advantages"].arrow_schema().names == [
        "uid", "token_rewards", "advantages", "returns"]


def test_every_stage_is_keyed_by_uid_and_columns_have_known_roles():
    assert set(STAGES) == {"rollout", "reward", "reference", "values", "old_logprobs",
                           "advantages", "validation"}
    for stage in STAGES.values():
        assert stage.columns[0] == "uid"
    for column in COLUMNS.values():
        assert column.writer in ROLES and set(column.readers) <= set(ROLES)
    assert COLUMNS["values"].readers == ("driver", "critic")
    assert COLUMNS["returns"].writer == "driver"


def test_get_stage_error_lists_valid_stages():
    with pytest.raises(ValueError, match="unknown stage 'rolout'.*reward, rollout, validation"):
        get_stage("rolout")


def test_describe_schema_is_markdown_with_short_types():
    text = describe_schema()
    assert "| `prompt_ids` | `list<int32>` | [B, P] | rollout | reward, reference, critic, actor |" in text
    assert "| `score` | `float32` | [B] | reward | driver |" in text
    assert "| `uid` | `string` | [B] | rollout | all |" in text
    assert "`reward.parquet` | `uid`, `score`" in text


def _prompts(**overrides):
    columns = {
        "data_source": ["gsm8k"],
        "prompt": [[{"role": "user", "content": "1+1?"}]],
        "ability": ["math"],
        "reward_model": [{"style": "rule", "ground_truth": "2"}],
        "extra_info": [{"index": 0}],
    }
    columns.update(overrides)
    return pa.table({name: value for name, value in columns.items() if value is not None})


def test_validate_prompts_accepts_verl_format_with_optional_columns_missing():
    validate_prompts_table(_prompts(), "train.parquet")
    validate_prompts_table(_prompts(data_source=None, ability=None, extra_info=None), "x")


@pytest.mark.parametrize("overrides, fragment", [
    ({"prompt": None}, "missing required column 'prompt'"),
    ({"reward_model": None}, "missing required column 'reward_model'"),
    ({"prompt": ["just a string"]}, "column 'prompt' has type string"),
    ({"reward_model": [{"style": "rule"}]}, "column 'reward_model' has type"),
    ({"reward_model": [{"ground_truth": 2}]}, "column 'reward_model' has type"),
    ({"data_source": [3]}, "column 'data_source' has type int64"),
    ({"reward_model": pa.array([{"ground_truth": None}],
                               pa.struct([("ground_truth", pa.string())]))},
     "ground_truth is null in 1 rows"),
])
def test_validate_prompts_rejects_bad_tables_naming_source(overrides, fragment):
    with pytest.raises(PromptSchemaError, match="^data/train.parquet: ") as error:
        validate_prompts_table(_prompts(**overrides), "data/train.parquet")
    assert fragment in str(error.value)
