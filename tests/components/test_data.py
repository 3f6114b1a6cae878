"""Tests for prompt loading and the deterministic prompt sampler."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.data import PromptSampler, load_prompts, read_prompt_table, render_prompt
from components.tasks.arithmetic import make_arithmetic_rows
from components.tiny import build_tokenizer


def _write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_chat_template_path(tmp_path, tokenizer):
    path = _write_rows(tmp_path / "a.parquet", make_arithmetic_rows(5, seed=0))
    records, filtered = load_prompts([path], tokenizer, max_prompt_length=64)
    assert filtered == 0 and [record.index for record in records] == list(range(5))
    rows = make_arithmetic_rows(5, seed=0)
    for record, row in zip(records, rows):
        content = row["prompt"][0]["content"]
        assert record.prompt_text == content  # the tiny template emits user content verbatim
        assert record.prompt_ids == list(tokenizer(content, add_special_tokens=False)["input_ids"])
        assert len(record.prompt_ids) == len(content.encode())  # byte-level: one token per byte
        assert record.ground_truth == record.target_text == row["reward_model"]["ground_truth"]
        assert record.data_source == "arithmetic"


def test_no_template_joins_contents_and_plain_strings(tmp_path, tokenizer):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "1+1="}]
    assert render_prompt(tokenizer, messages) == "sys\n1+1="
    with_template = build_tokenizer()
    assert render_prompt(with_template, messages) == "1+1="  # the tiny template drops system turns
    rows = [{"prompt": "2+2=", "reward_model": {"ground_truth": 4}}]
    path = _write_rows(tmp_path / "plain.parquet", rows)
    records, _ = load_prompts(path, with_template, max_prompt_length=8)
    assert records[0].prompt_text == "2+2=" and records[0].ground_truth == "4"
    assert records[0].data_source == "unknown"


def test_read_concatenates_files(tmp_path):
    first = _write_rows(tmp_path / "a.parquet", make_arithmetic_rows(3, seed=0))
    second = _write_rows(tmp_path / "b.parquet", make_arithmetic_rows(4, seed=1))
    table = read_prompt_table([first, f"file://{second}"])
    assert table.num_rows == 7
    assert table.column("source_row").to_pylist() == [0, 1, 2, 0, 1, 2, 3]


def test_overlong_filter_and_error(tmp_path, tokenizer):
    rows = [
        {"prompt": [{"role": "user", "content": text}], "reward_model": {"ground_truth": "x"}}
        for text in ("abc", "abcdefgh", "ab", "abcdef")
    ]
    path = _write_rows(tmp_path / "p.parquet", rows)
    records, filtered = load_prompts([path], tokenizer, max_prompt_length=4, overlong="filter")
    assert filtered == 2 and [record.prompt_text for record in records] == ["abc", "ab"]
    assert [record.index for record in records] == [0, 1]
    with pytest.raises(ValueError) as error:
        load_prompts([path], tokenizer, max_prompt_length=4, overlong="error", field="data.val_files")
    message = str(error.value)
    for expected in ("data.val_files", "row 1", "8 tokens", "max_prompt_length=4", "overlong_prompts=filter"):
        assert expected in message
    with pytest.raises(ValueError, match="all 4 prompts"):
        load_prompts([path], tokenizer, max_prompt_length=1)


def test_bad_inputs(tmp_path, tokenizer):
    missing = str(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match=r"data.train_files: file .*missing.parquet.* does not exist"):
        load_prompts([missing], tokenizer, max_prompt_length=8)
    no_reward = _write_rows(tmp_path / "n.parquet", [{"prompt": "hi"}])
    with pytest.raises(ValueError, match="no 'reward_model' column"):
        read_prompt_table([no_reward])
    empty = _write_rows(tmp_path / "e.parquet", [{"prompt": "", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(ValueError, match="row 0 .* is empty"):
        load_prompts([empty], tokenizer, max_prompt_length=8)


def test_sampler_epochs_are_permutations_and_straddle():
    sampler = PromptSampler(num_prompts=10, batch_size=4, seed=7)
    batches = [sampler.batch_indices(step) for step in range(5)]  # 20 positions = exactly 2 epochs
    flat = [index for batch in batches for index in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # epochs are reshuffled
    assert batches[2] == flat[8:12]  # step 2 straddles epochs 0 and 1
    # epoch_of reports the epoch of each batch's first prompt.
    assert [sampler.epoch_of(step) for step in range(5)] == [0, 0, 0, 1, 1]
    unshuffled = PromptSampler(10, 4, seed=7, shuffle=False)
    assert unshuffled.batch_indices(2) == [8, 9, 0, 1]


def test_sampler_determinism_and_seeds():
    first = PromptSampler(50, 8, seed=1)
    # A fresh instance asked for a late step first (as after a resume) agrees with a sequential one.
    resumed = PromptSampler(50, 8, seed=1)
    late = resumed.batch_indices(13)
    assert [first.batch_indices(step) for step in range(14)][13] == late
    assert PromptSampler(50, 8, seed=2).batch_indices(0) != first.batch_indices(0)
    with pytest.raises(ValueError, match="data.prompts_per_step=51"):
        PromptSampler(50, 51, seed=0)


GSM8K_ROW = {  # verl's GSM8K layout (examples/data_preprocess/gsm8k.py)
    "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "3+4?"}], "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "7"},
    "extra_info": {"split": "train", "index": 0, "answer": "3+4=7\n#### 7", "question": "3+4?"},
}


def test_extra_info_passes_as_json_and_the_worked_answer_is_the_warm_start_target(tmp_path, tokenizer):
    import json

    path = _write_rows(tmp_path / "g.parquet", [GSM8K_ROW])
    (record,), _ = load_prompts(path, tokenizer, max_prompt_length=64)
    assert json.loads(record.extra_info) == GSM8K_ROW["extra_info"]
    assert record.target_text == "3+4=7\n#### 7"  # auto: extra_info.answer
    (record,), _ = load_prompts(path, tokenizer, max_prompt_length=64, target="ground_truth")
    assert record.target_text == "7"
    (record,), _ = load_prompts(path, tokenizer, max_prompt_length=64, target="extra_info.question")
    assert record.target_text == "3+4?"
    with pytest.raises(ValueError, match=r"warm_start.target='extra_info.nope': row 0 of .* has no extra_info.nope"):
        load_prompts(path, tokenizer, max_prompt_length=64, target="extra_info.nope")
    with pytest.raises(ValueError, match=r"warm_start.target='answer' is not valid"):
        load_prompts(path, tokenizer, max_prompt_length=64, target="answer")
    # A file without extra_info: "null", and auto falls back to the ground truth.
    plain = _write_rows(tmp_path / "p.parquet", [{"prompt": "3+4?", "reward_model": {"ground_truth": "7"}}])
    (record,), _ = load_prompts(plain, tokenizer, max_prompt_length=64)
    assert record.extra_info == "null" and record.target_text == "7"


def test_a_demonstration_target_is_a_conversation_and_a_bad_one_is_named(tmp_path, tokenizer):
    turns = [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "7"},
             {"role": "assistant", "content": "7"}]
    row = {**GSM8K_ROW, "extra_info": {**GSM8K_ROW["extra_info"], "demonstration": turns,
                                       "dangling": turns[:2], "odd": [{"role": "user", "content": "hi"}]}}
    path = _write_rows(tmp_path / "d.parquet", [row])
    (record,), _ = load_prompts(path, tokenizer, max_prompt_length=64, target="extra_info.demonstration")
    assert record.target_text == tuple(turns)
    with pytest.raises(ValueError, match=r"warm_start.target='extra_info.dangling': row 0 .* must end with an "
                                         r"assistant message"):
        load_prompts(path, tokenizer, max_prompt_length=64, target="extra_info.dangling")
    with pytest.raises(ValueError, match=r"warm_start.target='extra_info.odd': row 0 .* message 0 is "
                                         r"\{'role': 'user', 'content': 'hi'\}"):
        load_prompts(path, tokenizer, max_prompt_length=64, target="extra_info.odd")


def test_an_empty_file_says_empty(tmp_path, tokenizer):
    schema = pa.schema([("prompt", pa.string()), ("reward_model", pa.struct([("ground_truth", pa.string())]))])
    path = tmp_path / "empty.parquet"
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(ValueError, match=r"data.val_files: the files hold no rows"):
        load_prompts([str(path)], tokenizer, max_prompt_length=8, field="data.val_files")
