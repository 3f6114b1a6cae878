"""flows.roles: where the rollout's vLLM engines go (rollout.engines), by hand."""

from __future__ import annotations

import pytest

from flows.config import build_config
from flows.roles import engine_placements, rollout_gpus


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
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # trainer.device=cuda resolves without a GPU
    workers = build_config({}, ["trainer.device=cuda", "trainer.execution=workers"])
    local = build_config({}, ["trainer.device=cuda", "trainer.execution=local"])
    assert rollout_gpus(workers, 4) == 4  # the rollout's worker sees exactly the rollout's GPUs
    assert rollout_gpus(local, 4) == 1  # one process on cuda:0
    assert rollout_gpus(local, 0) == 0
    assert rollout_gpus(build_config({}, ["trainer.device=cpu", "trainer.execution=workers"]), 4) == 0


# --- trained_role: a trained role's state must be the one the stage needs -------------------------

class _Role:
    def __init__(self, restored):
        self.restored, self.state_step, self.closed = restored, restored or 0, False

    def close(self):
        self.closed = True


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A config whose run folder has committed checkpoints 1 and 3 (latest 3), and an actor builder
    that records which checkpoint it was asked to restore (None: the initial weights)."""
    import json

    from flows import roles
    from flows.config import build_config

    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)}})
    layout = roles.layout_for(config)
    for step in (1, 3):
        folder = tmp_path / "r" / "checkpoints" / str(step)
        assert layout.checkpoint_dir(step) == str(folder), layout.checkpoint_dir(step)
        folder.mkdir(parents=True)
        (folder / "driver.json").write_text("{}")
    (tmp_path / "r" / "checkpoints" / "latest.json").write_text(json.dumps({"step": 3}))
    built = []

    def build(config, restore=roles.LATEST):
        built.append(_Role(roles.restore_point(config, "actor", restore)[0]))
        return built[-1]

    monkeypatch.setitem(roles.BUILDERS, "actor", build)
    yield config, built
    roles.release_run(config)


def test_a_role_holding_the_needed_state_is_used_as_it_is(trained):
    from flows.roles import trained_role

    config, built = trained
    first = trained_role(config, "actor", 3, "update_actor")  # built from the latest checkpoint
    assert [role.restored for role in built] == [3]
    assert trained_role(config, "actor", 3, "old_logprobs") is first and len(built) == 1


def test_a_role_left_midway_is_rebuilt_from_the_checkpoint_of_the_step(trained):
    from flows.roles import trained_role

    config, built = trained
    trained_role(config, "actor", 3, "update_actor").state_step = None  # an update that raised midway
    again = trained_role(config, "actor", 3, "update_actor")
    assert [role.restored for role in built] == [3, 3] and again is built[1] and built[0].closed
    again.state_step = 5  # e.g. a long-lived worker that ran further
    assert trained_role(config, "actor", 1, "checkpoint_actor").restored == 1
    assert trained_role(config, "actor", 0, "old_logprobs").restored is None  # step 0: the initial weights
    assert [role.restored for role in built] == [3, 3, 1, None]


def test_a_state_no_checkpoint_has_fails_with_one_line_saying_what_to_do(trained):
    from flows.roles import RoleStateError, trained_role

    config, _ = trained
    with pytest.raises(RoleStateError) as error:
        trained_role(config, "actor", 2, "update_actor")
    assert str(error.value) == (
        "stage update_actor at step 2: the actor holds the training state of step 3 and no checkpoint has step 2's "
        "(its worker was replaced, or an attempt of the stage stopped midway); resume the run: rlhf resume r "
        "(restarts at step 3)")


def test_a_worker_drops_the_roles_of_an_earlier_run_of_the_same_name(tmp_path, monkeypatch):
    """A long-lived worker serving a new run under an old name (run.overwrite=true) must not keep the
    old run's models: the run record's creation time tells the runs apart."""
    import json

    from flows import roles
    from flows.config import build_config

    config = build_config({"run": {"name": "same", "storage_root": str(tmp_path)}})
    record = tmp_path / "same" / "run.json"
    record.parent.mkdir(parents=True)
    built = []
    monkeypatch.setitem(roles.BUILDERS, "reference", lambda config: built.append(_Role(None)) or built[-1])
    try:
        record.write_text(json.dumps({"created": "2026-11-30T10:00:00"}))
        roles.forget_earlier_run(config)
        first = roles.get_role(config, "reference")
        roles.forget_earlier_run(config)  # the same run, a later stage: kept
        assert roles.get_role(config, "reference") is first and not first.closed
        record.write_text(json.dumps({"created": "2026-11-30T11:00:00"}))  # overwritten by a new run
        roles.forget_earlier_run(config)
        assert first.closed and roles.get_role(config, "reference") is not first and len(built) == 2
    finally:
        roles.release_run(config)


def test_a_vllm_rollout_worker_preloads_vllm_and_no_other_worker_does(tmp_path):
    from flows.config import build_config
    from flows.run import worker_preloads

    def preloads(engine, rollout_devices):
        config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)}, "model": {"path": "m"},
                               "data": {"train_files": ["t.parquet"]}, "rollout": {"engine": engine}})
        return worker_preloads(config, {"rollout": rollout_devices, "actor": [1], "reward": "cpu"})

    from components.vllm_rollout import vllm_supports

    assert preloads("hf", "cpu") == {}
    assert preloads("hf", [0]) == {}
    assert preloads("vllm", "cpu") == ({"rollout": ["vllm"]} if vllm_supports("cpu") else {})
    assert preloads("auto", [0]) == ({"rollout": ["vllm"]} if vllm_supports("cuda") else {})
    assert worker_preloads(build_config({"run": {"name": "r"}, "model": {"path": "m"},
                                         "data": {"train_files": ["t.parquet"]}}), {"actor": "cpu"}) == {}
