"""flows.training.engines: where the rollout's vLLM engines go (rollout.engines) and the engine options,
as functions of the config and the visible GPUs alone, by hand."""

from __future__ import annotations

import pytest
import torch

from flows.config import build_config
from flows.training.engines import engine_placements, rollout_gpus, vllm_options


def test_one_engine_per_gpu_group():
    assert engine_placements(2, 1, 2, "4,6") == [("4", 1), ("6", 1)]
    assert engine_placements(2, 2, 4, None) == [("0,1", 1), ("2,3", 1)]


def test_more_engines_than_groups_share_them_round_robin():
    assert engine_placements(2, 1, 1, "3") == [("3", 2), ("3", 2)]
    assert engine_placements(3, 1, 2, "4,6") == [("4", 2), ("6", 1), ("4", 2)]


def test_a_tensor_parallel_size_beyond_the_gpus_is_refused():
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2: only 1 GPUs"):
        engine_placements(1, 2, 1, None)


def test_the_rollout_gpus_follow_the_config_and_the_visible_devices_not_the_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # trainer.device=cuda resolves without a GPU
    workers = build_config({}, ["trainer.device=cuda", "trainer.execution=workers"])
    local = build_config({}, ["trainer.device=cuda", "trainer.execution=local"])
    assert rollout_gpus(workers, 4) == 4  # the rollout's worker sees exactly the rollout's GPUs
    assert rollout_gpus(local, 4) == 1  # one process on cuda:0
    assert rollout_gpus(local, 0) == 0
    assert rollout_gpus(build_config({}, ["trainer.device=cpu", "trainer.execution=workers"]), 4) == 0


@pytest.fixture
def cuda(monkeypatch):
    """trainer.device=cuda resolves without a GPU; this process 'has' 8 GPUs, which the options must not read."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def test_the_vllm_options_resolve_from_the_config_and_the_visible_count_alone(cuda):
    workers = build_config({}, ["trainer.device=cuda", "trainer.execution=workers"])
    options = vllm_options(workers, 4)
    assert options == vllm_options(workers, 4)  # no state: the same answer every time
    assert options["tensor_parallel_size"] == 4  # all 4 visible GPUs, one engine
    assert options["gpu_memory_utilization"] == 0.85  # the rollout has its GPUs to itself
    assert options["sleep"] is False and options["enforce_eager"] is False and options["kv_cache_gib"] is None
    assert options["max_model_len"] == 64 + 16  # data.max_prompt_length + rollout.max_new_tokens
    assert vllm_options(workers, 2)["tensor_parallel_size"] == 2  # follows `visible`, not the process's 8
    two = build_config({}, ["trainer.device=cuda", "trainer.execution=workers", "rollout.engines=2"])
    assert vllm_options(two, 4)["tensor_parallel_size"] == 2  # 4 GPUs among 2 engines
    assert vllm_options(two, 1)["tensor_parallel_size"] == 1  # never below 1


def test_a_rollout_sharing_its_gpu_takes_less_memory_and_sleeps(cuda):
    local = vllm_options(build_config({}, ["trainer.device=cuda", "trainer.execution=local"]), 4)
    assert local["gpu_memory_utilization"] == 0.4 and local["sleep"] is True
    assert local["tensor_parallel_size"] == 1  # local execution: cuda:0 only
    colocated = build_config({"placement": {"colocate": [["rollout", "actor"]]}},
                             ["trainer.device=cuda", "trainer.execution=workers"])
    assert vllm_options(colocated, 1)["gpu_memory_utilization"] == 0.4
    given = build_config({}, ["trainer.device=cuda", "trainer.execution=local", "rollout.gpu_memory_utilization=0.6"])
    assert vllm_options(given, 1)["gpu_memory_utilization"] == 0.6  # an explicit value wins


def test_a_sleeping_engine_sizes_its_kv_cache_for_a_steps_samples_unless_told(cuda):
    local = ["trainer.device=cuda", "trainer.execution=local", "data.prompts_per_step=5", "rollout.n=3"]
    # ceil(5 prompts / 1 engine) x 3 samples x (64 prompt + 16 new tokens)
    assert vllm_options(build_config({}, local), 1)["kv_cache_tokens"] == 5 * 3 * 80
    # two engines generate 3 and 2 of the prompts: each holds the larger share
    assert vllm_options(build_config({}, [*local, "rollout.engines=2"]), 1)["kv_cache_tokens"] == 3 * 3 * 80
    for told in ("rollout.gpu_memory_utilization=0.6", "rollout.kv_cache_gib=2", "rollout.sleep=off"):
        assert vllm_options(build_config({}, [*local, told]), 1)["kv_cache_tokens"] is None, told
    own = build_config({}, ["trainer.device=cuda", "trainer.execution=workers"])  # no sleep: 0.85 of its GPUs
    assert vllm_options(own, 1)["kv_cache_tokens"] is None


def test_a_tensor_parallel_size_beyond_the_visible_gpus_raises(cuda):
    config = build_config({}, ["trainer.device=cuda", "trainer.execution=workers", "rollout.tensor_parallel_size=4"])
    assert vllm_options(config, 4)["tensor_parallel_size"] == 4
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=4: only 2 GPUs are visible"):
        vllm_options(config, 2)


def test_on_the_cpu_the_options_take_no_gpu():
    options = vllm_options(build_config({}, ["trainer.device=cpu", "trainer.execution=workers"]), 4)
    assert options["tensor_parallel_size"] == 1 and options["kv_cache_gib"] == 1.0
    assert options["enforce_eager"] is True and options["sleep"] is False and options["kv_cache_tokens"] is None


def test_engine_kwargs_go_to_vllm_and_those_the_rollout_sets_itself_are_refused():
    from flows.config import build_config
    from flows.training.engines import vllm_options

    config = build_config({"rollout": {"engine_kwargs": {"max_num_seqs": 512, "max_num_batched_tokens": 16384}}})
    assert vllm_options(config, 0)["engine_kwargs"] == {"max_num_seqs": 512, "max_num_batched_tokens": 16384}
    assert vllm_options(build_config({}), 0)["engine_kwargs"] == {}
    with pytest.raises(ValueError) as error:
        build_config({"rollout": {"engine_kwargs": {"enable_sleep_mode": False}}})
    assert ("rollout.engine_kwargs: enable_sleep_mode: set by the rollout itself (rollout.sleep); the other vLLM "
            "engine arguments are allowed") in str(error.value)


def test_requests_are_seeded_except_for_vllm_on_a_gpu(cuda, monkeypatch):
    from flows.training import engines

    cpu = build_config({}, ["trainer.device=cpu"])
    assert engines.seeds_requests(cpu) is True  # the CPU: a resumed step samples its rollout again exactly
    gpu = build_config({}, ["trainer.device=cuda"])
    monkeypatch.setattr(engines, "rollout_engine_name", lambda config, device: "vllm")  # vLLM on this 'GPU'
    assert engines.seeds_requests(gpu) is False  # vLLM's sampler would draw each seeded request's noise apart
    assert engines.seeds_requests(gpu, "cpu") is True
    assert engines.seeds_requests(build_config({}, ["trainer.device=cuda", "rollout.seed_requests=true"])) is True
    assert engines.seeds_requests(build_config({}, ["trainer.device=cpu", "rollout.seed_requests=false"])) is False
    monkeypatch.setattr(engines, "rollout_engine_name", lambda config, device: "hf")
    assert engines.seeds_requests(gpu) is True  # transformers' generate: one seed per call, nothing to save


def test_the_logprob_check_runs_on_steps_1_2_and_every_tenth_for_vllm_on_a_gpu(cuda, monkeypatch):
    """rollout.logprobs_every: the rollout carries the engine's log-probs on steps 1 and 2 (the first after a weight
    sync) and on its multiples; default 1 (every step), 10 for vLLM on a GPU."""
    from flows.training import engines

    def checked(config, device_type=None):
        return [step for step in range(1, 32) if engines.checks_logprobs(config, step, device_type)]

    cpu = build_config({}, ["trainer.device=cpu"])
    assert checked(cpu) == list(range(1, 32))
    gpu = build_config({}, ["trainer.device=cuda"])
    monkeypatch.setattr(engines, "rollout_engine_name", lambda config, device: "vllm")
    assert checked(gpu) == [1, 2, 10, 20, 30]
    assert checked(gpu, "cpu") == list(range(1, 32))
    assert checked(build_config({}, ["trainer.device=cuda", "rollout.logprobs_every=1"])) == list(range(1, 32))
    assert checked(build_config({}, ["trainer.device=cpu", "rollout.logprobs_every=4"])) == [1, 2, 4, 8, 12, 16, 20,
                                                                                              24, 28]
    monkeypatch.setattr(engines, "rollout_engine_name", lambda config, device: "hf")
    assert checked(gpu) == list(range(1, 32))  # transformers' generate: the log-probs come from its scores anyway
    with pytest.raises(ValueError, match="rollout.logprobs_every"):
        build_config({}, ["rollout.logprobs_every=0"])
