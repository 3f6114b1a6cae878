"""The fault matrix, end to end on the CPU (real Prefect server, MLflow, Parquet): a stage that raises is
retried under workers; SIGTERM stops a run within seconds and leaves it resumable; a SIGKILLed driver leaves no
process behind and its flow run ends Crashed on resume; two runs share one server without touching each
other's stages; a live run cannot be started twice or overwritten; a resume checks every step's files and
rebuilds a lost checkpoint pointer, keeps its overrides, continues a stopped warm-start; a lost server and a
full disk end the driver with one line. Each ends with the uninterrupted run's final weights, or one line
and a resume to them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

from storage import RunLayout

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _workers_config(make_config, tmp_path, name, **sections):
    sections.setdefault("actor", {"ppo_mini_batch_size": 2, "micro_batch_size": 4, "use_kl_loss": True})
    sections.setdefault("reward", {"function": "flaky_reward:exact_match_failing_once"})
    return make_config(tmp_path, name, "faults", placement={"default": "cpu"},
                       trainer={"total_steps": STEPS, "val_every": 0, "device": "cpu", "execution": "workers",
                                "worker_timeout_s": 4, "stage_retries": 1, "checkpoint_every": 1}, **sections)


def _local_config(make_config, tmp_path, name, **sections):
    sections.setdefault("warm_start", {"steps": 6, "batch_size": 8, "checkpoint_every": 2})
    return make_config(tmp_path, name, "faults-local",
                       trainer={"total_steps": STEPS, "val_every": 0, "device": "cpu", "checkpoint_every": 1},
                       **sections)


def _weights(config) -> dict[str, str]:
    root = Path(RunLayout(config.run.storage_root, config.run.name).run_dir)
    weights = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
               for path in sorted(root.glob(f"weights/actor/{STEPS}/*.safetensors"))}
    assert weights, f"no final weights under {root}"
    return weights


def _environment(tmp_path, prefect_api=None, **extra) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
               FLAKY_REWARD_MARKER=str(tmp_path / "reward-failed-once"), **extra)
    env.pop("PREFECT_API_URL", None)
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    return env


def _rlhf(tmp_path, env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.tools.cli", *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _config_file(tmp_path, config, name="config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path} was written:\n{process.stderr.read()}"
        assert time.monotonic() < deadline, f"{path} not written within {timeout_s} s"
        time.sleep(0.05)


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live process below `pid`."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = commands[child]
                frontier.append(child)
    return found


def _gone(pids, timeout_s: float) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _mlflow_run(config):
    record = json.loads(Path(RunLayout(config.run.storage_root, config.run.name).run_dir, "run.json").read_text())
    return MlflowClient(tracking_uri=config.tracking.tracking_uri).get_run(record["mlflow_run_id"]), record


def _flow_run_state(flow_run_id: str) -> str:
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.type.value


# --- under workers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers_baseline(prefect_api, tmp_path_factory, make_config):
    """An uninterrupted run under workers, whose reward function raises once: trainer.stage_retries=1 retries
    it in its worker, as Prefect does in one process; the run completes and cleans up after itself."""
    from flows.training.run import run_training

    tmp_path = tmp_path_factory.mktemp("workers-baseline")
    config = _workers_config(make_config, tmp_path, "baseline")
    env = _environment(tmp_path, prefect_api)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        summary, flow_run_id = run_training(config, start_workers=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert (tmp_path / "reward-failed-once").exists(), "the reward function never raised"
    return {"config": config, "weights": _weights(config), "flow_run_id": flow_run_id, "summary": summary}


def test_a_stage_that_raises_is_retried_under_workers_and_the_run_leaves_nothing_behind(workers_baseline):
    config = workers_baseline["config"]
    run, _ = _mlflow_run(config)
    assert run.info.status == "FINISHED"
    assert _flow_run_state(workers_baseline["flow_run_id"]) == "COMPLETED"
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[workers_baseline["flow_run_id"]])))
    # The validation before RL is the first stage to score (in the rollout's worker): it raised, and ran again.
    attempts = sorted((run.name, run.state.type.value) for run in task_runs if run.name == "validate-0")
    assert attempts == [("validate-0", "COMPLETED"), ("validate-0", "FAILED")], attempts
    failed = next(run for run in task_runs if run.name == "validate-0" and run.state.type.value == "FAILED")
    assert failed.state.message.endswith(
        "stage validate at step 0 (sample 'val-0'): reward function flaky_reward:exact_match_failing_once raised "
        "ConnectionError: the reward service did not answer (once) on sample 0 (data_source 'arithmetic'); fix the "
        "function (rlhf --debug shows its traceback)"), failed.state.message
    root = Path(config.run.storage_root)
    assert not (root / ".workers" / config.run.name).exists(), "heartbeats and result files left behind"
    assert not (root / ".prefect-results" / config.run.name).exists(), "Prefect parameter files left behind"


def test_sigterm_stops_a_run_within_seconds_and_leaves_it_resumable(workers_baseline, prefect_api, tmp_path,
                                                                    make_config):
    config = _workers_config(make_config, tmp_path, "baseline")
    (tmp_path / "reward-failed-once").touch()
    env = _environment(tmp_path, prefect_api)
    driver = _rlhf(tmp_path, env, "run", _config_file(tmp_path, config))
    _wait_for(Path(RunLayout(config.run.storage_root, "baseline").stage_path(1, "reward")), driver)
    children = _descendants(driver.pid)
    assert sum("--role" in command for command in children.values()) == 4, children
    stopped_at = time.monotonic()
    driver.send_signal(signal.SIGTERM)  # to the driver only, as `timeout` or a process manager sends it
    _, stderr = driver.communicate(timeout=60)
    assert time.monotonic() - stopped_at < 30, f"took {time.monotonic() - stopped_at:.0f} s to stop"
    assert driver.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.splitlines()[-1] == (f"SIGTERM: stopped; the run is resumable: rlhf resume baseline "
                                       f"--storage-root {config.run.storage_root}"), stderr
    assert "Traceback" not in stderr, stderr
    assert _gone(children, timeout_s=10) == [], "processes outlived the driver"
    run, record = _mlflow_run(config)
    assert run.info.status == "KILLED"
    assert _flow_run_state(record["attempts"][0]["flow_run_id"]) == "CANCELLED"
    resumed = subprocess.run([sys.executable, "-m", "flows.tools.cli", "resume", "baseline", "--storage-root",
                              config.run.storage_root], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert _weights(config) == workers_baseline["weights"]
    assert _mlflow_run(config)[0].info.status == "FINISHED"


def test_a_sigkilled_driver_leaves_no_process_behind_and_the_resume_ends_its_flow_run_crashed(
        workers_baseline, tmp_path, make_config):
    config = _workers_config(make_config, tmp_path, "baseline")
    (tmp_path / "reward-failed-once").touch()
    env = _environment(tmp_path)  # the embedded Prefect server, under tmp_path/.rlhf/prefect
    driver = _rlhf(tmp_path, env, "run", _config_file(tmp_path, config))
    _wait_for(Path(RunLayout(config.run.storage_root, "baseline").stage_path(1, "reward")), driver)
    children = _descendants(driver.pid)
    assert any("prefect server start" in command for command in children.values()), children
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert _gone(children, timeout_s=20) == [], {pid: children[pid] for pid in _gone(children, 0)}
    resumed = subprocess.run([sys.executable, "-m", "flows.tools.cli", "resume", "baseline", "--storage-root",
                              config.run.storage_root], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "never ended (its driver died): marked Crashed" in resumed.stdout + resumed.stderr, resumed.stdout
    assert _weights(config) == workers_baseline["weights"]
    _, record = _mlflow_run(config)
    first, second = (attempt["flow_run_id"] for attempt in record["attempts"])
    from flows.runtime.launcher import prefect_server, using_prefect_api

    home = tmp_path / ".rlhf" / "prefect"
    saved = os.environ.pop("PREFECT_API_URL", None)
    try:
        with prefect_server(prefect_home=home) as api_url, using_prefect_api(api_url, prefect_home=home):
            assert _flow_run_state(first) == "CRASHED"
            assert _flow_run_state(second) == "COMPLETED"
    finally:
        if saved:
            os.environ["PREFECT_API_URL"] = saved


def test_two_runs_share_a_server_and_a_live_run_cannot_be_started_again_or_overwritten(
        workers_baseline, prefect_api, tmp_path, make_config):
    gate = tmp_path / "gate"
    env = _environment(tmp_path, prefect_api, GATED_REWARD_GATE=str(gate))
    (tmp_path / "reward-failed-once").touch()
    # `first` waits in its first scoring stage until the gate opens: live for as long as the checks take.
    configs = {"first": _workers_config(make_config, tmp_path, "first",
                                        reward={"function": "gated_reward:exact_match_once_open"}),
               "second": _workers_config(make_config, tmp_path, "second")}
    # The MLflow store exists before both start: two processes creating one fresh SQLite store at once race in
    # MLflow's schema migration (seen here: "one migration expected to match one row").
    MlflowClient(tracking_uri=configs["first"].tracking.tracking_uri).search_experiments()
    drivers = {name: _rlhf(tmp_path, env, "run", _config_file(tmp_path, config, f"{name}.yaml"))
               for name, config in configs.items()}
    _wait_for(Path(RunLayout(configs["first"].run.storage_root, "first").run_dir, "run.json"), drivers["first"])
    for extra in ([], ["run.overwrite=true"]):
        # No time bound: beside two runs' ten processes a 2-core machine takes minutes to start a CLI at all.
        again = subprocess.run([sys.executable, "-m", "flows.tools.cli", "run", tmp_path / "first.yaml", *extra],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert again.returncode == 2, again.stderr
        assert again.stderr.splitlines() == [
            f"error: run.name='first' is live: pid {drivers['first'].pid} on {os.uname().nodename} holds it "
            f"({Path(configs['first'].run.storage_root, '.locks', 'first.lock')}); wait for it to end, stop it, or "
            "choose another run.name"], again.stderr
        assert drivers["first"].poll() is None
    assert Path(RunLayout(configs["first"].run.storage_root, "first").run_dir, "run.json").exists()
    gate.touch()
    for name, driver in drivers.items():
        _, stderr = driver.communicate(timeout=900)
        assert driver.returncode == 0, (name, stderr)
        assert _weights(configs[name]) == workers_baseline["weights"], name  # no stage of one ran in the other


# --- one process ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_baseline(prefect_api, tmp_path_factory, make_config):
    from flows.training.train import train

    tmp_path = tmp_path_factory.mktemp("local-baseline")
    config = _local_config(make_config, tmp_path, "local")
    assert train(config, return_state=True).is_completed()
    return _weights(config)


def test_a_resume_checks_every_step_rebuilds_the_checkpoint_pointer_and_keeps_its_overrides(
        local_baseline, prefect_api, tmp_path, make_config, tiny_inputs, caplog, monkeypatch):
    from flows.training.train import train

    config = _local_config(make_config, tmp_path, "local")
    monkeypatch.setenv("RLHF_INJECT_FAILURE", "update_actor:2")
    assert train(config, return_state=True).is_failed()
    monkeypatch.delenv("RLHF_INJECT_FAILURE")
    layout = RunLayout(config.run.storage_root, "local")
    reward_file = Path(layout.stage_path(1, "reward"))
    reward_file.write_bytes(reward_file.read_bytes()[:-40])  # truncated: a step before the resume point
    Path(layout.run_dir, "checkpoints", "latest.json").unlink()
    moved_model = tmp_path / "model-moved"
    shutil.copytree(tiny_inputs["model"], moved_model)
    caplog.clear()
    resumed = config.model_copy(update={"run": config.run.model_copy(update={"resume": True}),
                                        "model": config.model.model_copy(update={"path": str(moved_model)})})
    assert train(resumed, return_state=True).is_completed()
    out = caplog.text  # the flow's prints reach its Prefect logger (log_prints)
    assert "checkpoints/latest.json was missing: rebuilt from the newest whole checkpoint, step 2" in out
    assert ("steps/1/reward.parquet is corrupt or partial: step 1 is before checkpoint 2, where the run resumes, "
            "so nothing reruns it; moved to reward.parquet.corrupt") in out
    assert reward_file.with_name("reward.parquet.corrupt").exists() and not reward_file.exists()
    assert _weights(config) == local_baseline
    run, record = _mlflow_run(config)
    assert record["config"]["model"]["path"] == str(moved_model)  # the export and a later resume use it
    assert record["resumes"][0]["changed"] == {"model.path": [tiny_inputs["model"], str(moved_model)]}
    assert json.loads(run.data.tags["rlhf.resume.1.changed"]) == record["resumes"][0]["changed"]
    assert run.info.status == "FINISHED"


def test_a_run_killed_in_its_warm_start_continues_it_from_its_checkpoint(local_baseline, prefect_api, tmp_path,
                                                                          make_config):
    config = _local_config(make_config, tmp_path, "local")
    env = _environment(tmp_path, prefect_api, RLHF_INJECT_FAILURE="warm_start_checkpoint:4:kill")
    driver = _rlhf(tmp_path, env, "train", _config_file(tmp_path, config))
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == -signal.SIGKILL, stderr  # right after the warm-start's checkpoint of its step 4
    layout = RunLayout(config.run.storage_root, "local")
    assert Path(layout.run_dir, "warm_start", "checkpoint", "_COMMITTED").exists()
    assert not Path(layout.weights_dir("actor", 0)).exists()
    del env["RLHF_INJECT_FAILURE"]
    resumed = subprocess.run([sys.executable, "-m", "flows.tools.cli", "resume", "local", "--storage-root",
                              config.run.storage_root], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "warm-start: continuing at step 4/6 from its checkpoint" in resumed.stdout + resumed.stderr
    assert _weights(config) == local_baseline
    assert not Path(layout.run_dir, "warm_start").exists(), "the finished warm-start's checkpoint was kept"


def test_a_lost_prefect_server_ends_the_driver_with_one_line(tmp_path, make_config):
    config = _local_config(make_config, tmp_path, "lost", warm_start={"steps": 0})
    driver = _rlhf(tmp_path, _environment(tmp_path), "train", _config_file(tmp_path, config))
    _wait_for(Path(RunLayout(config.run.storage_root, "lost").stage_path(1, "reward")), driver)
    server = [pid for pid, command in _descendants(driver.pid).items() if "prefect server start" in command]
    assert len(server) == 1
    killed_at = time.monotonic()
    os.kill(server[0], signal.SIGKILL)
    _, stderr = driver.communicate(timeout=60)
    assert time.monotonic() - killed_at < 15
    assert driver.returncode == 1
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the Prefect server (pid {server[0]}) exited with code -9; the run stopped; when the "
                      f"server is back (or with none set, the embedded one): rlhf resume lost --storage-root "
                      f"{config.run.storage_root}"], stderr
    assert _mlflow_run(config)[0].info.status == "FAILED"


def _mount_small_disk(path: Path, megabytes: int) -> bool:
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                             capture_output=True)
    return mounted.returncode == 0


def test_a_full_disk_ends_the_run_with_one_line_and_a_resume_finishes_it(local_baseline, prefect_api, tmp_path,
                                                                          make_config):
    disk = tmp_path / "disk"
    if not _mount_small_disk(disk, 256):
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); the full-disk drill runs where it can")
    try:
        config = _local_config(make_config, tmp_path, "local", run={"name": "local", "storage_root": str(disk / "runs")})
        env = _environment(tmp_path, prefect_api)
        driver = _rlhf(tmp_path, env, "train", _config_file(tmp_path, config))
        _wait_for(Path(RunLayout(config.run.storage_root, "local").stage_path(1, "rollout")), driver)
        ballast = disk / "ballast"
        # The 3-step run ends about a second after this point: it is frozen (its whole session) while the disk
        # fills, or on a fast machine it could finish first and on a slow one the race decided where it failed.
        os.killpg(driver.pid, signal.SIGSTOP)
        try:
            subprocess.run(["dd", "if=/dev/zero", f"of={ballast}", "bs=1M"], capture_output=True)  # until full
        finally:
            os.killpg(driver.pid, signal.SIGCONT)
        _, stderr = driver.communicate(timeout=300)
        assert driver.returncode == 2, stderr
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: no space left on device writing under run.storage_root={config.run.storage_root}"), stderr
        assert errors[0].endswith(f"free space, then rlhf resume local --storage-root {config.run.storage_root}")
        ballast.unlink()
        resumed = subprocess.run([sys.executable, "-m", "flows.tools.cli", "resume", "local", "--storage-root",
                                  config.run.storage_root], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=600)
        assert resumed.returncode == 0, resumed.stderr
        assert _weights(config) == local_baseline
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
