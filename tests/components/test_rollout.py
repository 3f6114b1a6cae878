"""Tests for the transformers rollout engine (components/rollout.py)."""

import copy

import pytest
import torch

from components.actor import Actor
from components.batch import build_sequence_batch
from components.models import load_causal_lm, load_tokenizer
from components.rollout import Generation, HFRolloutEngine, SamplingParams
from components.tiny import TinyModelSpec, build_tiny_model
from components.actor import ActorConfig

SPEC = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                     num_hidden_layers=1)
PROMPTS = [[49, 50, 43, 51, 52, 61], [55], [40, 41, 42]]


@pytest.fixture(scope="module")
def other_path(tmp_path_factory):
    """Same architecture, different random weights."""
    spec = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                         num_hidden_layers=1, seed=7)
    return str(build_tiny_model(tmp_path_factory.mktemp("other"), spec))


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def model(model_path):
    return load_causal_lm(model_path, device="cpu")


@pytest.fixture(scope="module")
def eos_model(model, tokenizer):
    """A copy whose end-of-sequence logit is large enough to be sampled now and then.

    The output embedding is tied to the input one, so editing the EOS row only changes the EOS logit
    (and the embedding of an EOS input, which never occurs before the sequence stops).
    """
    eos_model = copy.deepcopy(model)
    with torch.no_grad():
        hidden = eos_model.model(input_ids=torch.tensor([sum(PROMPTS, [])])).last_hidden_state[0].mean(0)
        eos_model.model.embed_tokens.weight[tokenizer.eos_token_id] = 4.0 * hidden / hidden.norm() ** 2
    assert eos_model.lm_head.weight.data_ptr() == eos_model.model.embed_tokens.weight.data_ptr()
    return eos_model


def _manual_greedy(model, prompt, max_new_tokens, eos):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


def _recomputed_logprobs(model, tokenizer, prompts, generations, temperature):
    batch = build_sequence_batch([prompts[g.prompt_index] for g in generations],
                                 [g.response_ids for g in generations], tokenizer.pad_token_id)
    actor = Actor(model, tokenizer, ActorConfig(micro_batch_size=64), temperature=temperature)
    return actor.compute_logprobs(batch)[0]


def _check_invariants(generations, eos, max_new_tokens):
    for generation in generations:
        assert isinstance(generation, Generation)
        assert len(generation.logprobs) == len(generation.response_ids)
        if generation.finish_reason == "stop":
            assert generation.response_ids[-1] == eos
            assert eos not in generation.response_ids[:-1]
            assert 1 <= len(generation.response_ids) <= max_new_tokens
        else:
            assert generation.finish_reason == "length"
            assert eos not in generation.response_ids
            assert len(generation.response_ids) == max_new_tokens


def test_n_samples_prompt_major(model, tokenizer):
    for micro_batch_size in (256, 2):
        engine = HFRolloutEngine(model, tokenizer, micro_batch_size=micro_batch_size)
        generations = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=4, seed=0))
        assert [(g.prompt_index, g.sample_index) for g in generations] == [
            (p, s) for p in range(3) for s in range(3)
        ]
        _check_invariants(generations, tokenizer.eos_token_id, 4)


def test_sampled_logprobs_match_actor_and_stop_at_eos(eos_model, tokenizer):
    engine = HFRolloutEngine(eos_model, tokenizer)
    max_new_tokens = 6
    generations = engine.generate(PROMPTS, SamplingParams(n=8, temperature=0.7, max_new_tokens=max_new_tokens,
                                                          seed=0))
    assert len(generations) == 24
    reasons = {g.finish_reason for g in generations}
    assert reasons == {"stop", "length"}  # both paths are exercised
    _check_invariants(generations, tokenizer.eos_token_id, max_new_tokens)
    recomputed = _recomputed_logprobs(eos_model, tokenizer, PROMPTS, generations, 0.7)
    for row, generation in enumerate(generations):
        expected = recomputed[row, : len(generation.response_ids)]
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
        assert generation.text == tokenizer.decode(generation.response_ids, skip_special_tokens=True)
    # a stopped response's text drops the EOS marker
    stopped = next(g for g in generations if g.finish_reason == "stop")
    assert "<|endoftext|>" not in stopped.text


def test_top_k_restricts_and_renormalises(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer)
    top_k, temperature = 5, 0.7
    generations = engine.generate(PROMPTS[:2], SamplingParams(n=4, temperature=temperature, top_k=top_k,
                                                              max_new_tokens=3, seed=1))
    for generation in generations:
        prompt = PROMPTS[generation.prompt_index]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + generation.response_ids])).logits[0]
        logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(generation.response_ids)] / temperature
        top_values, top_ids = logits.topk(top_k, dim=-1)
        for step, token in enumerate(generation.response_ids):
            assert token in top_ids[step].tolist()
            position = top_ids[step].tolist().index(token)
            expected = torch.log_softmax(top_values[step], -1)[position]
            assert generation.logprobs[step] == pytest.approx(float(expected), abs=1e-4)


def test_greedy_is_deterministic_and_equals_argmax(model, eos_model, tokenizer):
    eos = tokenizer.eos_token_id
    for current in (model, eos_model):
        engine = HFRolloutEngine(current, tokenizer)
        params = SamplingParams(n=2, temperature=0, max_new_tokens=5)
        first = engine.generate(PROMPTS, params)
        second = engine.generate(PROMPTS, params)
        assert [g.response_ids for g in first] == [g.response_ids for g in second]
        _check_invariants(first, eos, 5)
        for generation in first:
            assert generation.response_ids == _manual_greedy(current, PROMPTS[generation.prompt_index], 5, eos)
        # greedy log-probs are those of the untempered distribution
        recomputed = _recomputed_logprobs(current, tokenizer, PROMPTS, first, 1.0)
        for row, generation in enumerate(first):
            torch.testing.assert_close(torch.tensor(generation.logprobs),
                                       recomputed[row, : len(generation.response_ids)], atol=1e-4, rtol=0)


def test_forced_eos_mid_sequence(model, tokenizer):
    """Make EOS the argmax exactly at step 2 of one greedy continuation: it stops there."""
    eos, prompt = tokenizer.eos_token_id, PROMPTS[0]
    continuation = _manual_greedy(model, prompt, 3, eos)
    assert eos not in continuation
    forced = copy.deepcopy(model)
    with torch.no_grad():
        ids = torch.tensor([prompt + continuation[:2]])
        hidden = forced.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 :]  # steps 0, 1, 2
        logits = forced(input_ids=ids).logits[0, len(prompt) - 1 :]
        basis, _ = torch.linalg.qr(hidden[:2].T)  # span of the step-0 and step-1 hidden states
        direction = hidden[2] - basis @ (basis.T @ hidden[2])
        forced.model.embed_tokens.weight[eos] = direction * (logits[2].max() + 5.0) / (hidden[2] @ direction)
    engine = HFRolloutEngine(forced, tokenizer)
    generations = engine.generate([prompt, PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=6))
    assert generations[0].response_ids == continuation[:2] + [eos]
    assert generations[0].finish_reason == "stop"
    assert generations[1].response_ids == _manual_greedy(forced, PROMPTS[1], 6, eos)
    _check_invariants(generations, eos, 6)


def test_seed_makes_sampling_reproducible(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer)
    first = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=123))
    second = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=123))
    other = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=124))
    assert [g.response_ids for g in first] == [g.response_ids for g in second]
    assert [g.logprobs for g in first] == [g.logprobs for g in second]
    assert [g.response_ids for g in first] != [g.response_ids for g in other]


def test_generate_text_uses_byte_tokens(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer)
    by_text = engine.generate_text(["12+34="], SamplingParams(temperature=0, max_new_tokens=4))
    by_ids = engine.generate([list(b"12+34=")], SamplingParams(temperature=0, max_new_tokens=4))
    assert by_text[0].response_ids == by_ids[0].response_ids


def _all_params(model):
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


def test_load_weights_replaces_parameters(model_path, other_path, tokenizer):
    engine = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    reference = load_causal_lm(other_path, device="cpu")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prompts = PROMPTS + [[60 + i, 70 + i] for i in range(5)]
    before_sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5))
    engine.load_weights(other_path)
    loaded = dict(engine.model.named_parameters())
    for name, parameter in reference.named_parameters():
        assert torch.equal(loaded[name], parameter), name
    # the tied output head follows the loaded embedding
    assert torch.equal(engine.model.lm_head.weight, reference.model.embed_tokens.weight)
    after = [g.response_ids for g in engine.generate(prompts, params)]
    expected = [_manual_greedy(reference, prompt, 6, tokenizer.eos_token_id) for prompt in prompts]
    assert after == expected
    # sampled generations now follow the new weights (a random tiny model's greedy output mostly
    # repeats the last prompt token, so compare seeded samples and their log-probs instead)
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5)
    after_sampled = engine.generate(prompts, sampled)
    expected_sampled = HFRolloutEngine(reference, tokenizer).generate(prompts, sampled)
    assert [g.response_ids for g in after_sampled] == [g.response_ids for g in expected_sampled]
    for got, want in zip(after_sampled, expected_sampled):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert [g.response_ids for g in after_sampled] != [g.response_ids for g in before_sampled]


def test_load_weights_rejects_empty_folder(model_path, tmp_path):
    engine = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    with pytest.raises(ValueError, match="safetensors"):
        engine.load_weights(str(tmp_path))


def test_load_weights_rejects_extra_layers(model_path, tmp_path):
    spec = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                         num_hidden_layers=2)
    deeper = build_tiny_model(tmp_path / "deeper", spec)
    engine = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    with pytest.raises(ValueError, match="do not match"):
        engine.load_weights(str(deeper))


def test_load_weights_rejects_other_hidden_size(model_path, tmp_path):
    spec = TinyModelSpec(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=1)
    wider = build_tiny_model(tmp_path / "wider", spec)
    engine = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    with pytest.raises(ValueError):
        engine.load_weights(str(wider))


def test_rejected_load_leaves_weights_unchanged(model_path, tmp_path):
    spec = TinyModelSpec(hidden_size=64, num_attention_heads=1, num_key_value_heads=1, intermediate_size=128,
                         num_hidden_layers=2, seed=3)
    deeper = build_tiny_model(tmp_path / "deeper", spec)
    engine = HFRolloutEngine.from_pretrained(model_path, device="cpu")
    before = _all_params(engine.model)
    with pytest.raises(ValueError):
        engine.load_weights(str(deeper))
    after = _all_params(engine.model)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_generation_stops_at_every_eos_the_model_declares(model, tokenizer):
    """generation_config.json may list several eos ids; the engine ends a response at the first of any of them."""
    prompt = PROMPTS[0]
    first = _manual_greedy(model, prompt, 1, eos=tokenizer.eos_token_id)[0]
    assert first != tokenizer.eos_token_id
    declaring = copy.deepcopy(model)
    declaring.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    engine = HFRolloutEngine(declaring, tokenizer)
    assert engine.eos_token_ids == [tokenizer.eos_token_id, first]
    generation = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert (generation.response_ids, generation.finish_reason) == ([first], "stop")
    # The model as it was stops only at the tokenizer's eos, so the same greedy response goes on past `first`.
    plain = HFRolloutEngine(model, tokenizer).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert plain.response_ids[0] == first and len(plain.response_ids) > 1


def test_a_stop_string_ends_a_response_even_where_padding_is_the_eos(model, tokenizer):
    """A row ended by a stop string is padded to the batch's longest; where pad == eos (SmolLM2's tokenizer) that
    padding must not read as an eos the policy wrote: the response ends with the stop string, finish "stop"."""
    stopping, running = PROMPTS[0], PROMPTS[1]
    continuation = _manual_greedy(model, stopping, 6, eos=tokenizer.eos_token_id)
    stop = tokenizer.decode(continuation[:1])  # one token: a longer one could match across the prompt's end
    assert stop and stop not in tokenizer.decode(_manual_greedy(model, running, 6, eos=tokenizer.eos_token_id))
    padded_with_eos = copy.deepcopy(tokenizer)
    padded_with_eos.pad_token = padded_with_eos.eos_token
    assert padded_with_eos.pad_token_id == tokenizer.eos_token_id
    engine = HFRolloutEngine(model, padded_with_eos)
    first, second = engine.generate([stopping, running], SamplingParams(temperature=0.0, max_new_tokens=6,
                                                                        stop=(stop,)))
    assert (first.response_ids, first.finish_reason) == (continuation[:1], "stop")
    assert (len(second.response_ids), second.finish_reason) == (6, "length")


def test_the_stop_string_search_finds_the_shortest_prefix_that_holds_a_stop(tokenizer):
    """Against the one-decode-per-length search it replaced: the same prefix length for stops at the start, in the
    middle, at the end, split across tokens, two stops (the earlier wins), and none."""
    from types import SimpleNamespace

    engine = SimpleNamespace(tokenizer=tokenizer)
    tokens = tokenizer("x = 12*34 </tool_call> and 5 more", add_special_tokens=False)["input_ids"]

    def linear(stops):
        return next((length for length in range(1, len(tokens) + 1)
                     if any(stop in tokenizer.decode(tokens[:length], skip_special_tokens=False) for stop in stops)),
                    None)

    cases = [["x"], ["</tool_call>"], ["l>"], ["more"], ["5 more"], ["34 </tool"], ["more", "12"], ["absent"]]
    found = [HFRolloutEngine._stop_string_end(engine, tokens, stops) for stops in cases]
    assert found == [linear(stops) for stops in cases]
    assert found[0] == 1 and found[-1] is None and found[3] == len(tokens)
    text = lambda length: tokenizer.decode(tokens[:length], skip_special_tokens=False)  # noqa: E731
    for stops, length in zip(cases[:-1], found[:-1]):  # shortest: one token less holds no stop
        assert any(stop in text(length) for stop in stops) and not any(stop in text(length - 1) for stop in stops)
