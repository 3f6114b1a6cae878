"""flows.runtime.weights.handover and the driver's use of it: a stage declared to need the policy's weights
gets the actor's sender beside it when that version is streamed, a stage that changes the weights waits for
every sender first (their metrics with its own), and a run that ends abandons the senders still waiting."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from flows.config import build_config
from flows.runtime.driver import Pending, RunState
from flows.runtime.weights import HandOvers, handover

SENDER = SimpleNamespace(name="send_weights", output=None)
ROLLOUT = SimpleNamespace(name="rollout", output="rollout", needs_policy_weights=True, weights_sender=SENDER)
VALIDATE = SimpleNamespace(name="validate", output="validation", needs_policy_weights=True, weights_sender=SENDER)
UPDATE = SimpleNamespace(name="update_actor", output="weights/actor")


class _Driver:
    """RunState's start and wait: records what it starts; a stage in `finished` is found finished (a resume)."""

    def __init__(self, finished=()):
        self.started, self.finished = [], set(finished)

    def start(self, stage, *args) -> Pending:
        self.started.append((stage.name, *args))
        return Pending(stage, args[0] if args else None, metrics={"done": 1.0} if stage.name in self.finished else None)

    def wait(self, pending: Pending) -> dict[str, float]:
        return pending.metrics or {f"{pending.stage.name}/{pending.step}": 1.0}


def _config(tmp_path, execution):
    return build_config({"run": {"name": "r", "storage_root": str(tmp_path)}, "trainer": {"execution": execution}})


def test_a_stage_needing_the_policy_runs_alone_when_the_version_is_not_streamed(tmp_path):
    driver = _Driver()
    local = HandOvers(_config(tmp_path, "local"), driver.start, driver.wait)  # in memory, in the actor's process
    local.submit(ROLLOUT, 3, 2)
    local.submit(VALIDATE, 4)
    workers = HandOvers(_config(tmp_path, "workers"), driver.start, driver.wait)
    workers.submit(ROLLOUT, 0, 0)  # the initial policy is the engine's own: nothing to stream
    assert driver.started == [("rollout", 3, 2), ("validate", 4), ("rollout", 0, 0)]
    assert local.senders == [] and workers.senders == [] and local.wait() == {}


def test_a_streamed_version_gets_the_actors_sender_beside_its_stage_named_by_one_sync(tmp_path):
    driver = _Driver()
    handovers = HandOvers(_config(tmp_path, "workers"), driver.start, driver.wait)
    handovers.submit(ROLLOUT, 3, 2)  # one_step_ahead: step 3 samples with policy 2
    handovers.submit(VALIDATE, 4)  # validation: the policy of its step
    (rollout, rollout_sender, validate, validate_sender) = driver.started
    rollout_sync, validate_sync = rollout[-1], validate[-1]
    assert re.fullmatch(r"rollout-3-[0-9a-f]{8}", rollout_sync) and re.fullmatch(r"validate-4-[0-9a-f]{8}", validate_sync)
    assert rollout == ("rollout", 3, 2, rollout_sync) and validate == ("validate", 4, validate_sync)
    assert rollout_sender == ("send_weights", 2, rollout_sync, "rollout", 3)
    assert validate_sender == ("send_weights", 4, validate_sync, "validate", 4)
    assert [sync for sync, _pending in handovers.senders] == [rollout_sync, validate_sync]
    assert handovers.wait() == {"send_weights/2": 1.0, "send_weights/4": 1.0} and handovers.senders == []


def test_a_stage_a_resumed_run_finished_gets_no_sender(tmp_path):
    driver = _Driver(finished={"rollout"})
    handovers = HandOvers(_config(tmp_path, "workers"), driver.start, driver.wait)
    assert handovers.submit(ROLLOUT, 3, 3).metrics == {"done": 1.0}
    assert [name for name, *_ in driver.started] == ["rollout"] and handovers.senders == []


def test_a_run_that_ends_abandons_the_senders_still_waiting(tmp_path, monkeypatch):
    abandoned = []
    monkeypatch.setattr(handover, "transport_for", lambda config: SimpleNamespace(
        streams=lambda version: True, abandon=abandoned.append))
    driver = _Driver()
    handovers = HandOvers(_config(tmp_path, "workers"), driver.start, driver.wait)
    handovers.submit(ROLLOUT, 1, 1)
    handovers.submit(VALIDATE, 1)
    syncs = [sync for sync, _pending in handovers.senders]
    handovers.abandon()
    assert abandoned == syncs and handovers.senders == []


@pytest.fixture
def run_state(tmp_path, monkeypatch):
    """A RunState of a run under workers whose stages start and end in `_Driver` (no Prefect, no workers);
    `waited`: the stages whose own metrics the driver took, in order."""
    state, driver = RunState(_config(tmp_path, "workers"), tracker=None, kl_controller=None, artifacts=None), _Driver()
    waited = []

    def wait(pending):
        waited.append(pending.stage.name)
        return driver.wait(pending)

    monkeypatch.setattr(state, "_start", driver.start)
    monkeypatch.setattr(state, "_wait", wait)
    state.handovers = HandOvers(state.config, state._start, state.wait)
    return SimpleNamespace(state=state, driver=driver, waited=waited)


def test_the_driver_arranges_the_sender_and_the_update_waits_for_it_with_its_metrics(run_state):
    state, driver = run_state.state, run_state.driver
    rollout = state.submit(ROLLOUT, 3, 2)
    assert [name for name, *_ in driver.started] == ["rollout", "send_weights"]
    assert state.wait(rollout) == {"rollout/3": 1.0}
    update = state.submit(UPDATE, 3)  # the sender is waited for before the actor's weights change
    assert state.handovers.senders == [] and run_state.waited == ["rollout", "send_weights"]
    assert state.wait(update) == {"send_weights/2": 1.0, "update_actor/3": 1.0}
    assert state.committed_policy(0) is None  # the initial policy has no stored copy to wait for
