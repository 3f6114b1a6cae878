"""Tests for the supervised warm start (components/sft.py)."""

import pytest
import torch

from components.models import load_causal_lm, load_tokenizer
from components.rollout import HFRolloutEngine, SamplingParams
from components.sft import warm_start
from components.tiny import TinyModelSpec

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture
def model(model_path):
    return load_causal_lm(model_path, device="cpu")


def _target_nll(model, prompt, target):
    """Mean negative log-likelihood of the target tokens given the prompt, on the unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + target])).logits[0]
    log_probs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(target)], dim=-1)
    return float(-log_probs.gather(-1, torch.tensor(target)[:, None]).mean())


def test_warm_start_learns_a_single_example(model, tokenizer):
    prompt = list(b"12+34=")
    assert tokenizer("12+34=", add_special_tokens=False)["input_ids"] == prompt
    target = list(b"46") + [tokenizer.eos_token_id]
    initial_nll = _target_nll(model, prompt, target)
    reported = []
    losses = warm_start(model, tokenizer, [prompt], ["46"], steps=30, batch_size=2, lr=1e-2,
                        on_step=lambda step, loss: reported.append((step, loss)))
    assert len(losses) == 30
    assert reported == list(zip(range(1, 31), losses))  # after each step, 1-based, with that step's loss
    # the first loss is the target-only NLL (prompt tokens excluded, EOS included) before any step
    assert losses[0] == pytest.approx(initial_nll, abs=1e-4)
    assert losses[-1] < 0.05 * losses[0]
    assert sum(losses[-5:]) < sum(losses[:5])
    assert not model.training
    generation = HFRolloutEngine(model, tokenizer).generate([prompt], SamplingParams(temperature=0,
                                                                                      max_new_tokens=6))[0]
    assert generation.response_ids == target
    assert generation.finish_reason == "stop"
    assert generation.text == "46"


def test_warm_start_is_seeded(model_path, tokenizer):
    prompts = [list(b"1+1="), list(b"10+20=")]
    targets = ["2", "30"]
    runs = []
    for seed in (0, 0, 1):
        model = load_causal_lm(model_path, device="cpu")
        runs.append(warm_start(model, tokenizer, prompts, targets, steps=4, batch_size=1, lr=1e-3, seed=seed))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_warm_start_mixed_lengths_first_loss_is_token_mean(model, tokenizer):
    """Batch of both examples (different prompt and target lengths): token-mean over target+EOS tokens."""
    prompts = [list(b"1+1="), list(b"10+20=")]
    targets = [list(b"2") + [tokenizer.eos_token_id], list(b"300") + [tokenizer.eos_token_id]]
    rows = torch.randint(2, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    total, count = 0.0, 0
    for row in rows:
        total += _target_nll(model, prompts[row], targets[row]) * len(targets[row])
        count += len(targets[row])
    losses = warm_start(model, tokenizer, prompts, ["2", "300"], steps=1, batch_size=8, lr=1e-3, seed=0)
    assert losses[0] == pytest.approx(total / count, abs=1e-4)


DEMONSTRATION = [{"role": "assistant", "content": "c(2*3)"}, {"role": "tool", "content": "6"},
                 {"role": "assistant", "content": "6"}]


def test_a_demonstration_is_laid_out_as_a_rollout_with_the_tools_answer_masked(tokenizer):
    from components.sft import target_tokens

    eos = tokenizer.eos_token_id
    assert target_tokens(tokenizer, "46") == (list(b"46") + [eos], [1, 1, 1])
    ids, mask = target_tokens(tokenizer, DEMONSTRATION, tool_response_template="<r>{result}</r>")
    assert ids == list(b"c(2*3)") + list(b"<r>6</r>") + list(b"6") + [eos]
    assert mask == [1] * 6 + [0] * 8 + [1, 1]


def test_the_warm_start_loss_leaves_the_tools_answer_out(model, tokenizer):
    """The first loss is the mean NLL of the policy's tokens only: the tool's answer is read, not trained on."""
    prompt = list(b"2*3=")
    template = "<r>{result}</r>"
    sequence = list(b"c(2*3)<r>6</r>6") + [tokenizer.eos_token_id]
    trained = [1] * 6 + [0] * 8 + [1, 1]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + sequence])).logits[0]
    log_probs = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(sequence)], dim=-1)
    nll = -log_probs.gather(-1, torch.tensor(sequence)[:, None])[:, 0]
    expected = float((nll * torch.tensor(trained)).sum() / sum(trained))
    everything = float(nll.mean())
    assert abs(expected - everything) > 1e-3  # the check below could tell the two apart
    losses = warm_start(model, tokenizer, [prompt], [DEMONSTRATION], steps=1, batch_size=1, lr=1e-3,
                        tool_response_template=template)
    assert losses[0] == pytest.approx(expected, abs=1e-4)
