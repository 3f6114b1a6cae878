"""`flows.runtime.tracking` and `flows.runtime.system_metrics` against a real MLflow SQLite store in tmp_path."""

from __future__ import annotations

import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows.config import build_config
from flows.runtime.system_metrics import start_system_metrics, stop_system_metrics
from flows.runtime.tracking import Tracker, find_active_run_id


def _config(tmp_path, name="exp-a", **sections):
    data = {
        "run": {"name": name, "storage_root": str(tmp_path / "runs")},
        "model": {"path": "models/tiny"},
        "algorithm": {"adv_estimator": "rloo"},
        "data": {"prompts_per_step": 4},
        "rollout": {"n": 2},
        "trainer": {"total_steps": 7, "execution": "workers"},
        "warm_start": {"steps": 3},
        "placement": {"roles": {"actor": [1], "reference": [1], "reward": "cpu"}, "default": [0]},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "unit"},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return build_config(data)


def test_tags_describe_the_run(tmp_path):
    config = _config(tmp_path)
    tracker = Tracker(config)
    tags = MlflowClient(tracking_uri=tracker.uri).get_run(tracker.run_id).data.tags
    assert tags["rlhf.run_name"] == "exp-a"
    assert tags["rlhf.algorithm"] == "rloo"
    assert tags["mlflow.source.git.commit"]
    assert tags["rlhf.placement"] == "rollout=0 actor=1 critic=0 reference=1 reward=cpu"
    assert tags["rlhf.execution"] == "workers"
    assert tags["mlflow.note.content"] == (
        "**exp-a**: `rloo` post-training of `models/tiny` for 7 RL steps after a 3-step supervised "
        "warm-start, 4 prompts x 2 samples per step, execution `workers`, placement "
        f"`rollout=0 actor=1 critic=0 reference=1 reward=cpu`; stage files under `{tmp_path}/runs/exp-a`.")


def test_placement_tag_shows_defaults_and_gpu_lists(tmp_path):
    config = _config(tmp_path, placement={"roles": {"actor": [0, 1]}, "default": "auto"},
                     algorithm={"adv_estimator": "gae"}, trainer={"execution": "local"}, warm_start={"steps": 0})
    tracker = Tracker(config)
    tags = MlflowClient(tracking_uri=tracker.uri).get_run(tracker.run_id).data.tags
    assert tags["rlhf.placement"] == "rollout=auto actor=0,1 critic=auto reference=auto reward=auto"
    assert tags["rlhf.execution"] == "local"
    assert tags["mlflow.note.content"].startswith(
        "**exp-a**: `gae` with a critic post-training of `models/tiny` for 7 RL steps, 4 prompts x 2 samples")


def test_config_is_logged_as_json_and_yaml_that_reads_back(tmp_path):
    config = _config(tmp_path)
    tracker = Tracker(config)
    client = MlflowClient(tracking_uri=tracker.uri)
    assert {a.path for a in client.list_artifacts(tracker.run_id)} >= {"config.json", "config.yaml"}
    local = client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path / "download"))
    with open(local) as handle:
        assert build_config(yaml.safe_load(handle)) == config
    assert client.get_run(tracker.run_id).data.params["placement.default"] == "[0]"


def test_log_model_folder_uploads_every_file(tmp_path):
    tracker = Tracker(_config(tmp_path))
    weights = tmp_path / "weights" / "actor" / "7"
    (weights / "sub").mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"\0" * 64)
    (weights / "config.json").write_text("{}")
    (weights / "sub" / "extra.txt").write_text("x")
    tracker.log_model_folder(weights)
    tracker.log_model_folder(str(weights), artifact_path="final")
    client = MlflowClient(tracking_uri=tracker.uri)
    listed = {a.path: a for a in client.list_artifacts(tracker.run_id, "model")}
    assert set(listed) == {"model/model.safetensors", "model/config.json", "model/sub"}
    assert listed["model/model.safetensors"].file_size == 64
    assert [a.path for a in client.list_artifacts(tracker.run_id, "model/sub")] == ["model/sub/extra.txt"]
    assert "final/model.safetensors" in {a.path for a in client.list_artifacts(tracker.run_id, "final")}
    with pytest.raises(FileNotFoundError, match="not a folder"):
        tracker.log_model_folder(tmp_path / "missing")


def test_find_active_run_id_finds_only_the_running_run_of_that_name(tmp_path):
    config = _config(tmp_path)
    assert find_active_run_id(config) is None  # no store yet, and none is created
    assert not (tmp_path / "mlflow.db").exists()
    finished = Tracker(config)
    finished.finish()
    assert find_active_run_id(config) is None
    running = Tracker(config)
    other = Tracker(_config(tmp_path, name="exp-b"))
    assert find_active_run_id(config) == running.run_id
    assert find_active_run_id(_config(tmp_path, name="exp-b")) == other.run_id
    assert find_active_run_id(_config(tmp_path, tracking={"experiment": "elsewhere"})) is None
    running.finish("FAILED")
    assert find_active_run_id(config) is None


def _wait_for_metric(client, run_id, key, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        history = client.get_metric_history(run_id, key)
        if history:
            return history
        time.sleep(0.2)
    return []


def test_system_metrics_are_logged_under_the_role(tmp_path):
    config = _config(tmp_path)
    assert start_system_metrics(config, "actor", sampling_interval=0.5) is None  # no run yet
    tracker = Tracker(config)
    client = MlflowClient(tracking_uri=tracker.uri)
    monitor = start_system_metrics(config, "actor", sampling_interval=0.5)
    try:
        assert monitor is not None
        assert start_system_metrics(config, "actor", sampling_interval=0.5) is monitor
        # MLflow names node metrics system/<node id>/<metric>.
        history = _wait_for_metric(client, tracker.run_id, "system/actor/cpu_utilization_percentage")
        assert history, sorted(client.get_run(tracker.run_id).data.metrics)
        assert 0.0 <= history[0].value <= 100.0
        assert _wait_for_metric(client, tracker.run_id, "system/actor/system_memory_usage_megabytes")[0].value > 0
        assert "system/cpu_utilization_percentage" not in client.get_run(tracker.run_id).data.metrics
        # A new run of another name: the old monitor stops, a new one follows the new run.
        other = Tracker(_config(tmp_path, name="exp-b"))
        second = start_system_metrics(_config(tmp_path, name="exp-b"), "actor", sampling_interval=0.5)
        assert second is not None and second is not monitor
        assert monitor._process is None  # finished
        assert _wait_for_metric(client, other.run_id, "system/actor/cpu_utilization_percentage")
    finally:
        stop_system_metrics(monitor)
        stop_system_metrics()
    stop_system_metrics()  # nothing running: a no-op
    tracker.finish()
    other.finish()


def test_credentials_in_uris_never_reach_mlflow():
    from flows.runtime.tracking import redact_credentials, run_tags

    assert redact_credentials("s3://AKIA:secret/x@bucket/runs") == "s3://AKIA:secret/x@bucket/runs"  # '/' ends userinfo
    assert redact_credentials("s3://AKIA:s3cr3t@bucket/runs") == "s3://***@bucket/runs"
    assert redact_credentials("postgresql://me:pw@db:5432/mlflow and gs://b/x") == "postgresql://***@db:5432/mlflow and gs://b/x"
    assert redact_credentials("/plain/path") == "/plain/path"
    config = build_config({}, ["run.storage_root=s3://key:secret@bucket/runs"])
    tags = run_tags(config)
    assert "secret" not in " ".join(tags.values()) and tags["rlhf.storage_root"] == "s3://***@bucket/runs"
