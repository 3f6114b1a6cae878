"""flows.runtime.residents: each role loads once per run in a process; another run's roles are closed."""

from __future__ import annotations

import json

import pytest

from flows.config import build_config
from flows.runtime import residents
from flows.runtime.residents import forget_earlier_run, release_role, release_run, resident


class _Role:
    def __init__(self, name):
        self.name, self.closed = name, False

    def close(self):
        self.closed = True


@pytest.fixture
def runs(tmp_path):
    """Two runs' configs; every resident of either is dropped afterwards."""
    first = build_config({"run": {"name": "first", "storage_root": str(tmp_path)}})
    second = build_config({"run": {"name": "second", "storage_root": str(tmp_path)}})
    yield first, second
    release_run(first)
    release_run(second)


def _builder(built, name):
    def build():
        built.append(_Role(name))
        return built[-1]
    return build


def test_a_role_is_built_once_per_run_and_counted(runs, monkeypatch):
    first, _ = runs
    built = []
    monkeypatch.setattr(residents, "LOAD_COUNTS", {})  # this process's counts, from zero
    one = resident(first, "test-actor", _builder(built, "test-actor"))
    assert resident(first, "test-actor", _builder(built, "test-actor")) is one and len(built) == 1
    assert residents.LOAD_COUNTS == {"test-actor": 1}
    other = resident(first, "test-critic", _builder(built, "test-critic"))  # another role of the run: kept beside
    assert other is not one and not one.closed and len(built) == 2
    assert resident(first, "test-actor", _builder(built, "test-actor")) is one
    assert residents.LOAD_COUNTS == {"test-actor": 1, "test-critic": 1}


def test_the_same_name_under_another_storage_root_is_another_run(runs, tmp_path):
    first, _ = runs
    elsewhere = build_config({"run": {"name": "first", "storage_root": str(tmp_path / "elsewhere")}})
    built = []
    try:
        one = resident(first, "test-actor", _builder(built, "a"))
        two = resident(elsewhere, "test-actor", _builder(built, "b"))
        assert two is not one and one.closed and len(built) == 2
    finally:
        release_run(elsewhere)


def test_a_request_for_another_run_closes_the_earlier_runs_roles(runs):
    first, second = runs
    built = []
    actor = resident(first, "test-actor", _builder(built, "actor"))
    reference = resident(first, "test-reference", _builder(built, "reference"))
    plain = resident(first, "test-prompts", lambda: ["no close()"])  # nothing to close: dropped all the same
    new = resident(second, "test-actor", _builder(built, "actor"))
    assert actor.closed and reference.closed and not new.closed and new is not actor
    assert resident(first, "test-prompts", lambda: ["again"]) == ["again"] and plain == ["no close()"]


def test_releasing_a_role_or_a_run(runs):
    first, _ = runs
    built = []
    actor = resident(first, "test-actor", _builder(built, "actor"))
    critic = resident(first, "test-critic", _builder(built, "critic"))
    release_role(first, "test-actor")
    assert actor.closed and not critic.closed
    rebuilt = resident(first, "test-actor", _builder(built, "actor"))
    assert rebuilt is not actor and len(built) == 3
    release_role(first, "test-never-built")  # nothing held: nothing to do
    release_run(first)
    assert rebuilt.closed and critic.closed
    assert resident(first, "test-critic", _builder(built, "critic")) is built[-1] and len(built) == 4


def test_a_worker_drops_the_roles_of_an_earlier_run_of_the_same_name(tmp_path):
    """A long-lived worker serving a new run under an old name (run.overwrite=true) must not keep the
    old run's models: the run record's creation time tells the runs apart."""
    config = build_config({"run": {"name": "same", "storage_root": str(tmp_path)}})
    record = tmp_path / "same" / "run.json"
    record.parent.mkdir(parents=True)
    built = []
    try:
        forget_earlier_run(config)  # no run record yet (a stage called outside a run): nothing to tell apart
        record.write_text(json.dumps({"created": "2026-11-30T10:00:00"}))
        forget_earlier_run(config)
        first = resident(config, "reference", _builder(built, "reference"))
        forget_earlier_run(config)  # the same run, a later stage: kept
        assert resident(config, "reference", _builder(built, "reference")) is first and not first.closed
        record.write_text(json.dumps({"created": "2026-11-30T11:00:00"}))  # overwritten by a new run
        forget_earlier_run(config)
        assert first.closed and resident(config, "reference", _builder(built, "reference")) is not first
        assert len(built) == 2
    finally:
        release_run(config)
        residents._RUN_CREATED.pop(f"{tmp_path}/same", None)


@pytest.fixture
def stopping():
    """This process asked to stop (SIGTERM, Ctrl-C), as the CLI's signal handler marks it; unmarked afterwards."""
    from flows.runtime.supervision import STOPPING

    STOPPING.set()
    yield
    STOPPING.clear()


def test_a_stop_fences_the_released_run_so_a_stage_still_running_builds_nothing(runs, stopping):
    """The flow's `finally` releases the run's roles while a stage may still run on another thread: during a stop,
    no role of that run is built again (a vLLM engine nothing would close); another run is not fenced."""
    from flows.runtime.supervision import Stopped

    first, second = runs
    built = []
    engine = resident(first, "test-rollout", _builder(built, "rollout"))
    release_run(first)
    assert engine.closed and residents.stopped(first)
    with pytest.raises(Stopped, match="the run was stopped and its roles released; role test-rollout is not built"):
        resident(first, "test-rollout", _builder(built, "rollout"))
    assert len(built) == 1
    assert resident(second, "test-rollout", _builder(built, "rollout")) is built[-1] and not residents.stopped(second)


def test_a_role_that_finishes_loading_after_the_stop_released_its_run_is_closed_again(runs, stopping):
    from flows.runtime.supervision import Stopped

    first, _ = runs
    built = []

    def build_while_the_stop_releases():
        role = _builder(built, "rollout")()
        release_run(first)  # the stop, on the main thread, while this role loads
        return role

    with pytest.raises(Stopped, match="stopped while role test-rollout was built"):
        resident(first, "test-rollout", build_while_the_stop_releases)
    assert built[0].closed and "test-rollout" not in [name for _, name in residents._RESIDENTS]


def test_a_run_released_without_a_stop_is_built_again_and_the_fence_is_lifted(runs):
    from flows.runtime.supervision import STOPPING

    first, _ = runs
    built = []
    STOPPING.set()
    try:
        release_run(first)
        assert residents.stopped(first)
    finally:
        STOPPING.clear()
    assert not residents.stopped(first)  # a later run in this process (the tests, the Python API) builds again
    release_run(first)  # the end of a run that was not stopped
    assert residents._run_key(first) not in residents._STOPPED
    assert resident(first, "test-actor", _builder(built, "actor")) is built[-1]
