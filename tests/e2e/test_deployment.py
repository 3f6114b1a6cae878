"""prefect.yaml as a user runs it: create a work pool, deploy, start a worker, trigger a run, wait.

Against the session's real local Prefect server, with the Prefect CLI in subprocesses (as in the
README's "Deployments" section). The run is the `quickstart` deployment with its config parameter
replaced by a 2-step tiny run, executed by a process worker in a separate flow-run process, which
must find flows/training/train.py through the deployment's pull step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from storage import RunLayout, validate_stage_file

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
PROMPTS, SAMPLES = 4, 4


def _env(api_url: str, prefect_home: Path, pwd: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PREFECT_API_URL=api_url, PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", MLFLOW_ENABLE_TELEMETRY="false",
               PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5",
               # A parent that is not a shell leaves PWD as it found it; the deployment must not
               # depend on it (prefect.yaml records the folder `prefect deploy` really runs in).
               PWD=str(pwd))
    return env


def _prefect(args: list[str], env: dict[str, str], cwd: Path = REPO_ROOT, timeout: float = 120) -> str:
    """Run a Prefect CLI command; on failure, fail the test with its output."""
    process = subprocess.Popen([*PREFECT, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"`prefect {' '.join(args)}` did not finish within {timeout} s:\n{output[-4000:]}")
    finally:
        if process.poll() is None:  # e.g. KeyboardInterrupt while waiting
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, f"`prefect {' '.join(args)}` exited {process.returncode}:\n{output[-4000:]}"
    return output


def _tiny_config(tmp_path: Path, tiny_inputs: dict, run_name: str) -> dict:
    return {
        "run": {"name": run_name, "storage_root": str(tmp_path / "runs"), "overwrite": True},
        "model": {"path": tiny_inputs["model"]},
        "data": {"train_files": [tiny_inputs["train"]], "val_files": [tiny_inputs["validation"]],
                 "max_prompt_length": 16, "prompts_per_step": PROMPTS},
        "rollout": {"n": SAMPLES, "max_new_tokens": 4},
        "actor": {"ppo_mini_batch_size": 2, "micro_batch_size": 4, "use_kl_loss": False},
        "warm_start": {"steps": 0},
        "trainer": {"total_steps": 2, "val_every": 0, "device": "cpu"},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "deployment-e2e"},
    }


def _read_deployment(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_deploy_from_prefect_yaml_and_run_on_a_process_worker(prefect_api, tmp_path, tiny_inputs):
    if os.environ.get("PREFECT_API_URL"):
        pytest.skip("PREFECT_API_URL points at an existing server: this test (re)deploys rlhf-train/quickstart "
                    "and rlhf-train/nightly, so it runs only against the test session's own server")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment

    env = _env(prefect_api, tmp_path / "prefect-home", pwd=tmp_path)
    pool = f"rlhf-test-{uuid.uuid4().hex[:8]}"

    # 1. Work pools: the one prefect.yaml names (for `deploy --all`) and a fresh one for this run.
    _prefect(["work-pool", "create", "rlhf-local", "--type", "process", "--overwrite"], env)
    _prefect(["work-pool", "create", pool, "--type", "process"], env)

    # 2. `prefect deploy --all` as the README says: both user-facing deployments, nightly unscheduled.
    _prefect(["--no-prompt", "deploy", "--all"], env)
    nightly = _read_deployment("rlhf-train/nightly")
    assert nightly.work_pool_name == "rlhf-local"
    assert [(s.schedule.cron, s.active) for s in nightly.schedules] == [("0 2 * * *", False)]
    quickstart = _read_deployment("rlhf-train/quickstart")
    assert quickstart.entrypoint == "flows/training/train.py:train"
    assert quickstart.parameters["config"]["trainer"]["total_steps"] == 50
    # The pull step holds the checkout's absolute path, resolved when deploying (not a template).
    assert quickstart.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}]

    # 3. One deployment onto the fresh pool (--name selects it from prefect.yaml, --pool overrides).
    _prefect(["--no-prompt", "deploy", "--name", "quickstart", "--pool", pool], env)
    assert _read_deployment("rlhf-train/quickstart").work_pool_name == pool

    # 4. Trigger it with a 2-step tiny run (the config parameter replaces the deployment's whole).
    run_name = f"deployed-{uuid.uuid4().hex[:6]}"
    config = _tiny_config(tmp_path, tiny_inputs, run_name)
    # The experiment made here keeps the run's artifacts under tmp_path (MLflow's default is
    # ./mlruns of the flow run's working directory: the checkout).
    client = MlflowClient(tracking_uri=config["tracking"]["tracking_uri"])
    experiment_id = client.create_experiment("deployment-e2e", artifact_location=(tmp_path / "mlartifacts").as_uri())
    flow_run = run_deployment("rlhf-train/quickstart", parameters={"config": config}, timeout=0)

    # 5. A worker polls once, runs the flow in its own process (cwd elsewhere: the pull step must
    # move it to the checkout) and exits when the run has finished.
    worker_cwd = tmp_path / "worker"
    worker_cwd.mkdir()
    output = _prefect(["worker", "start", "--pool", pool, "--run-once", "--name", f"{pool}-worker"], env,
                      cwd=worker_cwd, timeout=240)

    # 6. The run completed (run_deployment does not raise on a failed child), wrote its files,
    # and its MLflow run finished.
    with get_client(sync_client=True) as prefect_client:
        finished = prefect_client.read_flow_run(flow_run.id)
    assert finished.state is not None and finished.state.type == StateType.COMPLETED, \
        f"flow run {flow_run.id} ended {finished.state}; worker output:\n{output[-6000:]}"
    assert finished.deployment_id == quickstart.id
    assert finished.parameters["config"]["run"]["name"] == run_name

    layout = RunLayout(config["run"]["storage_root"], run_name)
    for step in range(2):
        assert validate_stage_file(layout, step, "advantages", expected_rows=PROMPTS * SAMPLES), step
    assert layout.latest_weights("actor")[0] == 2

    runs = client.search_runs([experiment_id], filter_string=f"tags.`rlhf.run_name` = '{run_name}'")
    assert [run.info.status for run in runs] == ["FINISHED"]
    assert runs[0].data.params["trainer.total_steps"] == "2"
    assert runs[0].data.metrics["critic/score/mean"] >= 0.0
    assert (tmp_path / "mlartifacts").is_dir()
