"""Tests for SequenceBatch, build_sequence_batch and response_logits (components/batch.py)."""

import pytest
import torch

from components.batch import PaddingPlan, SequenceBatch, build_sequence_batch, model_logits, response_logits
from components.models import load_causal_lm, load_tokenizer
from components.tiny import TinyModelSpec, build_tiny_model

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("m"), SPEC)
    return load_causal_lm(str(path), device="cpu"), load_tokenizer(str(path))


@pytest.fixture
def batch():
    return build_sequence_batch([[1, 2], [3]], [[4], [5, 6, 7]], pad_token_id=0)


def test_build_sequence_batch_exact_layout(batch):
    assert batch.prompt_length == 2
    assert batch.input_ids.tolist() == [[1, 2, 4, 0, 0], [0, 3, 5, 6, 7]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
    assert batch.response_mask.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert batch.input_ids.dtype == torch.long
    assert batch.attention_mask.dtype == torch.long
    assert batch.position_ids.dtype == torch.long
    assert batch.response_mask.dtype == torch.float32
    assert batch.size == 2
    assert batch.response_length == 3
    assert batch.response_ids.tolist() == [[4, 0, 0], [5, 6, 7]]


def test_build_sequence_batch_nonzero_pad_value():
    batch = build_sequence_batch([[1, 2, 3], [4]], [[5, 6], []], pad_token_id=9)
    assert batch.prompt_length == 3
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 6], [9, 9, 4, 9, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_select_keeps_every_field(batch):
    for indices in (torch.tensor([1]), slice(1, 2)):
        picked = batch.select(indices)
        assert isinstance(picked, SequenceBatch)
        assert picked.prompt_length == 2
        assert picked.input_ids.tolist() == [[0, 3, 5, 6, 7]]
        assert picked.attention_mask.tolist() == [[0, 1, 1, 1, 1]]
        assert picked.position_ids.tolist() == [[0, 0, 1, 2, 3]]
        assert picked.response_mask.tolist() == [[1.0, 1.0, 1.0]]
        assert picked.response_ids.tolist() == [[5, 6, 7]]
    reordered = batch.select(torch.tensor([1, 0]))
    assert reordered.input_ids.tolist() == [[0, 3, 5, 6, 7], [1, 2, 4, 0, 0]]
    assert reordered.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_to_keeps_every_field(batch):
    moved = batch.to("cpu")
    assert moved.prompt_length == batch.prompt_length
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(getattr(moved, name), getattr(batch, name))
        assert getattr(moved, name).dtype == getattr(batch, name).dtype
    moved = batch.to(torch.device("cpu"))
    assert moved.input_ids.device.type == "cpu"


def test_all_responses_empty_keeps_one_masked_column():
    batch = build_sequence_batch([[1, 2], [3]], [[], []], pad_token_id=0)
    assert batch.prompt_length == 2
    assert batch.response_length == 1
    assert batch.input_ids.tolist() == [[1, 2, 0], [0, 3, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 0], [0, 1, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch.response_mask.tolist() == [[0.0], [0.0]]
    assert batch.response_mask.dtype == torch.float32


def test_some_responses_empty():
    batch = build_sequence_batch([[1], [2]], [[], [5]], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 0], [2, 5]]
    assert batch.response_mask.tolist() == [[0.0], [1.0]]
    assert batch.attention_mask.tolist() == [[1, 0], [1, 1]]


def _manual_response_logprobs(model, prompt, response, temperature):
    """Log-probs and entropies of `response` from the model run on the unpadded sequence alone."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logits, chosen, entropy


PROMPTS = [[49, 50, 43, 51, 52, 61], [55], [40, 41, 42]]
RESPONSES = [[100, 101], [10, 20, 30, 40, 256], [7]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logits_match_unpadded_forward(tiny, temperature):
    model, tokenizer = tiny
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, batch, temperature)
    assert logits.shape == (3, 5, len(tokenizer))
    assert logits.dtype == torch.float32
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        expected_logits, expected_logprobs, _ = _manual_response_logprobs(model, prompt, response, temperature)
        got = logits[row, : len(response)]
        torch.testing.assert_close(got, expected_logits, atol=1e-4, rtol=0)
        got_logprobs = torch.log_softmax(got, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        torch.testing.assert_close(got_logprobs, expected_logprobs, atol=1e-4, rtol=0)


def test_response_logits_temperature_scales(tiny):
    model, tokenizer = tiny
    batch = build_sequence_batch(PROMPTS, RESPONSES, tokenizer.pad_token_id)
    with torch.no_grad():
        plain = response_logits(model, batch)
        hot = response_logits(model, batch, temperature=2.0)
    torch.testing.assert_close(hot * 2.0, plain, atol=1e-5, rtol=1e-5)


def test_padding_plan_bounds_by_hand(batch):
    # prompts [1, 2] and [_, 3]; responses [4, _, _] and [5, 6, 7]
    plan = PaddingPlan(batch)
    assert plan.left_padding.tolist() == [0, 1]
    assert plan.response_extent.tolist() == [1, 3]
    assert plan.lengths.tolist() == [3, 4]
    assert plan.bounds(torch.tensor([0, 1])) == (0, 3)
    assert plan.bounds(torch.tensor([1])) == (1, 3)
    assert plan.bounds(slice(0, 1)) == (0, 1)
    narrowed = batch.select(torch.tensor([1])).narrow(1, 3)
    assert narrowed.input_ids.tolist() == [[3, 5, 6, 7]] and narrowed.prompt_length == 1
    assert narrowed.position_ids.tolist() == [[0, 1, 2, 3]]
    assert narrowed.response_ids.tolist() == [[5, 6, 7]]


def test_padding_plan_aligns_each_cut_by_left_padding_first_then_response_columns(batch):
    """On CUDA (multiple 8) a cut's length is a multiple of the given number where the batch has the columns:
    left padding kept first (no LM-head work), then response columns (their mask is 0), never past the batch."""
    from components.batch import aligned

    assert aligned(torch.device("cuda")) == 8 and aligned(torch.device("cpu")) == 1
    # the batch above: prompts [1, 2] and [_, 3]; responses [4, _, _] and [5, 6, 7]; 2 + 3 columns
    plan = PaddingPlan(batch, multiple=4)
    assert plan.bounds(slice(0, 1)) == (0, 2)  # length 3 -> 4: one response column more
    assert plan.bounds(torch.tensor([1])) == (1, 3)  # length 4 already
    assert plan.bounds(torch.tensor([0, 1])) == (0, 3)  # length 5: the batch has no more columns
    # prompts [1, 2, 3, 4] and [_, _, _, 5]; responses [6, _] and [7, 8]
    long_prompt = build_sequence_batch([[1, 2, 3, 4], [5]], [[6], [7, 8]], pad_token_id=0)
    assert PaddingPlan(long_prompt).bounds(torch.tensor([1])) == (3, 2)  # length 3
    assert PaddingPlan(long_prompt, multiple=4).bounds(torch.tensor([1])) == (2, 2)  # one left-padding column kept
    assert PaddingPlan(long_prompt, multiple=8).bounds(torch.tensor([1])) == (0, 2)  # all 6 columns, no more


def test_padding_plan_keeps_one_prompt_column_and_one_response_column():
    batch = build_sequence_batch([[0], [0]], [[], []], pad_token_id=0)  # empty responses
    batch.attention_mask[:, 0] = 0  # and no prompt token either
    assert PaddingPlan(batch).bounds(slice(0, 2)) == (0, 1)


def test_narrowed_micro_batch_gives_the_same_logits_on_its_tokens(tiny):
    model, _ = tiny
    batch = build_sequence_batch([[5, 6, 7], [8]], [[9, 10], [11]], pad_token_id=0)
    with torch.no_grad():
        full = model_logits(model, batch)  # [2, 3, V]: predicts response tokens 0, 1 and past the end
        row = batch.select(torch.tensor([1]))
        drop, width = PaddingPlan(row).bounds(slice(0, 1))
        assert (drop, width) == (2, 1)
        narrowed = model_logits(model, row.narrow(drop, width))  # [1, 2, V]
        assert PaddingPlan(row, multiple=4).bounds(slice(0, 1)) == (0, 1)  # aligned: both left-padding columns kept
        aligned_logits = model_logits(model, row.narrow(0, 1))
    torch.testing.assert_close(narrowed[0, :1], full[1, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aligned_logits[0, :1], full[1, :1], atol=1e-5, rtol=1e-5)
