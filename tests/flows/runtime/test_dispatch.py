"""flows.runtime.dispatch: RunTracker (when the driver takes a submitted stage for lost and submits it again)
and RemoteStage's dispatch time, with the worker side of a stage's result (flows.runtime.worker). Times are
hand-picked seconds; heartbeats are the dicts workers write."""

from __future__ import annotations

from flows.runtime.dispatch import RunTracker

TIMEOUT = 4.0
RUN = "run-1"


def beat(at, role="reward", running=(), done=(), idle_since=None, pid=1):
    return {"role": role, "pid": pid, "beat": at, "running": list(running), "done": list(done),
            "idle_since": idle_since}


def tracker():
    return RunTracker(RUN, "reward", TIMEOUT, now=100.0)


def test_a_stage_of_a_role_without_a_worker_is_watched_through_the_worker_that_serves_it():
    """A LoRA run's reference stages run in the actor's worker (`rlhf worker --role actor --also-serve reference`):
    its heartbeat's `serves` says so; an actor's worker that does not serve them is no worker for them."""
    runs = RunTracker(RUN, "reference", TIMEOUT, now=100.0)
    actor = beat(101.0, role="actor", idle_since=100.0)
    assert runs.observe([actor], running=False, now=101.0) == "no workers"
    assert runs.observe([{**actor, "serves": ["actor"]}], running=False, now=101.0) == "no workers"
    serving = {**actor, "serves": ["actor", "reference"]}
    assert runs.observe([serving], running=False, now=101.0) == "waiting"
    assert runs.observe([{**serving, "running": [RUN]}], running=True, now=101.5) == "attended"
    assert RunTracker(RUN, "actor", TIMEOUT, now=100.0).observe([serving], running=False, now=101.0) == "waiting"


def test_no_worker_serving_a_hosted_role_names_the_worker_to_start(tmp_path, monkeypatch):
    import time

    import pytest

    from flows.runtime.dispatch import RemoteStage, WorkerLostError
    from flows.runtime.worker import Heartbeat

    assert Heartbeat("actor", "cpu", str(tmp_path), also_serve=["reference"]).state["serves"] == ["actor", "reference"]
    monkeypatch.setenv("RLHF_WORKER_DIR", str(tmp_path / "no-workers"))
    stage = RemoteStage.__new__(RemoteStage)  # no server: only the verdict and its line
    stage.role, stage.worker_role, stage.relay, stage.worker_wait_s = "reference", "actor", None, 1.0
    stage.submitted_at, stage.tracker = time.monotonic() - 10, RunTracker(RUN, "reference", TIMEOUT)
    with pytest.raises(WorkerLostError, match=r"no live worker for role 'reference' after 1 s \(trainer.worker_wait_s\); "
                                              r"start one: rlhf worker --role actor --also-serve reference --devices"):
        stage._lost(None)


def test_a_run_whose_worker_stops_beating_is_lost_one_timeout_after_it_was_last_held():
    runs = tracker()
    assert runs.observe([beat(101.0, running=[RUN])], running=True, now=101.0) == "attended"
    dead = beat(101.0, running=[RUN])  # the killed worker's file stays, ever older
    assert runs.observe([dead], running=True, now=104.5) == "attended"  # its beat is 3.5 s old: still live
    assert runs.observe([dead], running=True, now=105.5) == "waiting"
    assert runs.observe([dead], running=True, now=104.5 + TIMEOUT - 0.1) == "waiting"  # last held at 104.5
    assert runs.observe([dead], running=True, now=104.5 + TIMEOUT + 0.1) == "lost"


def test_a_run_killed_before_the_server_saw_it_running_is_lost_once_the_replacement_sits_idle():
    """The CI failure: the worker wrote the run into its heartbeat and died before its Running event
    reached the server; the server's state stays Scheduled and the new worker never gets the run."""
    runs = tracker()
    assert runs.observe([beat(100.5, running=[RUN], pid=1)], running=False, now=100.5) == "attended"
    replacement = beat(110.0, idle_since=103.0, pid=2)
    assert runs.observe([replacement], running=False, now=104.0) == "waiting"
    assert runs.observe([replacement], running=False, now=100.5 + TIMEOUT + 0.1) == "lost"


def test_a_run_handed_to_a_worker_that_died_before_its_first_beat_is_lost_after_two_idle_timeouts():
    runs = tracker()
    replacement = beat(120.0, idle_since=102.0, pid=2)
    assert runs.observe([replacement], running=False, now=102.0 + 2 * TIMEOUT - 0.1) == "waiting"
    assert runs.observe([replacement], running=False, now=102.0 + 2 * TIMEOUT + 0.1) == "lost"


def test_idle_time_before_the_submission_does_not_count():
    runs = tracker()  # submitted at 100; the worker has been idle since 10
    assert runs.observe([beat(100.0 + 2 * TIMEOUT - 1, idle_since=10.0)], running=False,
                        now=100.0 + 2 * TIMEOUT - 1) == "waiting"
    assert runs.observe([beat(100.0 + 2 * TIMEOUT + 1, idle_since=10.0)], running=False,
                        now=100.0 + 2 * TIMEOUT + 1) == "lost"


def test_a_run_queued_behind_a_busy_worker_waits_however_long():
    runs = tracker()
    busy = beat(1000.0, running=["another-run"])
    assert runs.observe([busy], running=False, now=1000.0) == "waiting"


def test_a_run_its_worker_is_done_with_waits_for_its_final_state():
    runs = tracker()
    assert runs.observe([beat(500.0, done=["x", RUN], idle_since=150.0)], running=True, now=500.0) == "attended"


def test_workers_of_another_role_neither_hold_nor_count():
    runs = tracker()
    others = [beat(200.0, role="actor", running=[RUN]), beat(200.0, role="actor", idle_since=100.0)]
    assert runs.observe(others, running=False, now=200.0) == "no workers"
    assert runs.observe(others, running=True, now=200.0) == "lost"  # the server saw it run; nobody holds it


def test_a_published_stage_result_is_taken_once_and_the_file_removed(tmp_path):
    from flows.runtime.worker import publish_result, take_result

    result = {"path": "runs/x/step_00001/reward.parquet", "metrics": {"reward/mean": 0.25}, "worker_started_at": 5.0}
    assert take_result("run-1", str(tmp_path)) == (False, None)
    assert publish_result("run-1", result, str(tmp_path))
    assert [path.name for path in (tmp_path / "results").iterdir()] == ["run-1.json"]  # no .tmp left
    assert take_result("run-1", str(tmp_path)) == (True, result)
    assert take_result("run-1", str(tmp_path)) == (False, None)
    assert not list((tmp_path / "results").iterdir())


def test_a_result_that_cannot_be_published_leaves_the_driver_to_the_server_state(tmp_path, capsys):
    from flows.runtime.worker import publish_result, take_result

    (tmp_path / "results").write_text("a file where the results folder should be")
    assert publish_result("run-2", {"metrics": {}}, str(tmp_path)) is False
    assert "the driver waits for the Prefect state" in capsys.readouterr().out
    assert take_result("run-2", str(tmp_path)) == (False, None)


def test_dispatch_seconds_run_from_submission_to_the_start_in_the_worker():
    from flows.runtime.dispatch import RemoteStage

    stage = RemoteStage.__new__(RemoteStage)  # no server: only the arithmetic
    stage.submitted_wall = 100.0
    assert stage.dispatch_s({"metrics": {}, "worker_started_at": 100.25}) == 0.25
    assert stage.dispatch_s({"metrics": {}, "worker_started_at": 99.9}) == 0.0  # clocks a little apart
    assert stage.dispatch_s({"metrics": {}}) is None  # a stage run in the driver's process


def test_a_run_queued_while_its_worker_preloads_waits_then_counts_idle_time_from_the_end(tmp_path):
    """A rollout worker imports vLLM before serving (`--preload vllm`, 15-20 s on a GPU host, more than
    twice worker_timeout_s on a slow one): the validation queued for it meanwhile is not lost."""
    import json

    from flows.runtime.worker import Heartbeat

    heartbeat = Heartbeat("reward", "cpu", str(tmp_path))

    def written():
        return json.loads((tmp_path / heartbeat.path.rsplit("/", 1)[-1]).read_text())

    runs = tracker()  # submitted at 100
    with heartbeat.preloading(["vllm"]):
        during = written()
        assert during["idle_since"] is None and during["preloading"] == ["vllm"]
        assert runs.observe([{**during, "beat": 1000.0}], running=False, now=1000.0) == "waiting"
    after = written()
    assert "preloading" not in after and after["idle_since"] is not None
    ended = after["idle_since"]
    assert runs.observe([{**after, "beat": ended + 2 * TIMEOUT - 1}], running=False,
                        now=ended + 2 * TIMEOUT - 1) == "waiting"
    assert runs.observe([{**after, "beat": ended + 2 * TIMEOUT + 1}], running=False,
                        now=ended + 2 * TIMEOUT + 1) == "lost"


class _Payload:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_never_unpickled_by_the_driver(tmp_path):
    """Anyone who can write the (shared) worker folder must not run code in the driver (issue 20)."""
    import pickle

    from flows.runtime.worker import take_result

    marker = tmp_path / "executed"
    (tmp_path / "results").mkdir()
    for name in ("run-3.pkl", "run-3.json"):  # the old file name, and pickle bytes under the new one
        (tmp_path / "results" / name).write_bytes(pickle.dumps(_Payload(str(marker))))
    assert take_result("run-3", str(tmp_path)) == (False, None)
    assert not marker.exists()


def test_the_driver_prints_each_progress_line_of_its_workers_once_with_the_role(monkeypatch):
    from flows.runtime import dispatch
    from flows.runtime.dispatch import ProgressRelay

    shown: list[str] = []
    monkeypatch.setattr(dispatch, "show", shown.append)
    relay = ProgressRelay(since=1000.0)
    rollout = {"role": "rollout", "host": "h", "pid": 7, "progress": [
        [1, 990.0, "loading the rollout model (hf) ..."],  # before the run started (slack 5 s): an earlier run's
        [2, 996.0, "starting the vLLM rollout engine ..."]]}
    actor = {"role": "actor", "host": "h", "pid": 8, "progress": [[1, 1001.0, "loading the actor model ..."]]}
    relay.relay([rollout, actor])
    relay.relay([rollout, actor])  # read again: nothing new
    rollout["progress"].append([3, 1030.0, "starting the vLLM rollout engine: 20 s so far"])
    relay.relay([actor, rollout])
    assert shown == ["[rollout] starting the vLLM rollout engine ...", "[actor] loading the actor model ...",
                     "[rollout] starting the vLLM rollout engine: 20 s so far"]
    replacement = {"role": "rollout", "host": "h", "pid": 9, "progress": [[1, 1040.0, "loading the rollout model ..."]]}
    relay.relay([replacement])  # a new process numbers its lines from 1 again
    assert shown[-1] == "[rollout] loading the rollout model ..."


def test_a_workers_progress_lines_go_into_its_heartbeat_newest_kept(tmp_path):
    import json
    import logging

    from flows.runtime.worker import PROGRESS_KEPT, Heartbeat, ProgressToHeartbeat

    heartbeat = Heartbeat("actor", "cpu", str(tmp_path))
    logger = logging.getLogger("rlhf.progress.test-heartbeat")
    logger.setLevel(logging.INFO)
    logger.propagate = False  # this test's lines stay off the terminal
    handler = ProgressToHeartbeat(heartbeat)
    logger.addHandler(handler)
    try:
        for index in range(PROGRESS_KEPT + 3):
            logger.info("warm-start step %d/100", index)
    finally:
        logger.removeHandler(handler)
    (path,) = tmp_path.glob("actor-*.json")
    lines = json.loads(path.read_text())["progress"]  # written at once, not at the next beat
    assert [number for number, _, _ in lines] == list(range(4, PROGRESS_KEPT + 4))
    assert lines[-1][2] == f"warm-start step {PROGRESS_KEPT + 2}/100"
