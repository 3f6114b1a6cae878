"""`flows.runtime.tracking` and `flows.runtime.system_metrics` against a real MLflow SQLite store in tmp_path:
tags, params, the final policy as a registered MLflow model, lineage and the link to the Prefect flow run."""

from __future__ import annotations

import json
import time

import mlflow
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.tiny import build_tiny_model
from flows.config import ConfigError, build_config
from flows.runtime.system_metrics import start_system_metrics, stop_system_metrics
from flows.runtime.tracking import (LINEAGE_FILE, MAX_PARAM_LENGTH, Tracker, find_active_run_id, flow_run_tags,
                                    lineage_params)


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


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _greedy_ids(model, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return output[0, inputs["input_ids"].shape[1]:].tolist()


def test_the_final_policy_is_a_registered_mlflow_model_that_loads_and_generates(tmp_path, tiny_model):
    first = Tracker(_config(tmp_path))
    uri = first.log_model(tiny_model, generation_params={"max_new_tokens": 3, "temperature": 1.0, "do_sample": True})
    assert uri == f"runs:/{first.run_id}/model"
    client = MlflowClient(tracking_uri=first.uri)
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(first.run_id, "model")}
    assert first.register_model("unit-policy", {"val_reward_end": 0.25, "rlhf.run_name": "exp-a"}) == "1"
    # A run registers one version: again (a run resumed after registering) keeps it and updates its tags.
    assert first.register_model("unit-policy", {"val_reward_end": 0.5, "rlhf.run_name": "exp-a"}) == "1"
    second = Tracker(_config(tmp_path, name="exp-b"))
    second.log_model(str(tiny_model))
    assert second.register_model("unit-policy", {"val_reward_end": 0.125, "rlhf.run_name": "exp-b"}) == "2"

    versions = {str(v.version): v for v in client.search_model_versions("name = 'unit-policy'")}
    assert sorted(versions) == ["1", "2"]
    assert (versions["1"].run_id, versions["1"].tags) == (first.run_id, {"val_reward_end": "0.5", "rlhf.run_name": "exp-a"})
    assert (versions["2"].run_id, versions["2"].tags) == (second.run_id, {"val_reward_end": "0.125", "rlhf.run_name": "exp-b"})
    assert client.get_run(first.run_id).data.tags["rlhf.registered_model"] == "unit-policy/1"
    assert client.get_run(second.run_id).data.tags["rlhf.registered_model"] == "unit-policy/2"

    # The registered version generates what the folder it came from generates (greedy), as a transformers
    # pipeline and through pyfunc with the logged generation params.
    pipeline = mlflow.transformers.load_model("models:/unit-policy/1")
    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expected = _greedy_ids(reference, tokenizer, "12+34=", 3)
    assert _greedy_ids(pipeline.model, pipeline.tokenizer, "12+34=", 3) == expected
    model = mlflow.pyfunc.load_model("models:/unit-policy/1")
    assert {param.name: param.default for param in model.metadata.signature.params.params} == {
        "max_new_tokens": 3, "temperature": 1.0, "do_sample": True}
    (text,) = model.predict(["12+34="], params={"max_new_tokens": 3, "do_sample": False})
    assert text == "12+34=" + tokenizer.decode(expected)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        first.log_model(tmp_path / "missing")


@pytest.mark.parametrize(("value", "fragment"), [
    ("", "tracking.registered_model='': is empty"),
    ("   ", "tracking.registered_model='   ': is empty"),
    ("team/model", "tracking.registered_model='team/model': is not a model name"),
    (" rlhf", "tracking.registered_model=' rlhf': is not a model name"),
])
def test_a_bad_registered_model_name_is_one_line(value, fragment):
    with pytest.raises(ConfigError) as error:
        build_config({}, [f"tracking.registered_model={value}"])
    assert str(error.value).startswith(fragment) and "\n" not in str(error.value)


def test_registered_model_is_unset_by_default_and_null_unsets_it():
    assert build_config({}).tracking.registered_model is None
    assert build_config({}, ["tracking.registered_model=rlhf-nightly"]).tracking.registered_model == "rlhf-nightly"
    assert build_config({"tracking": {"registered_model": "x"}}, ["tracking.registered_model=null"]).tracking.registered_model is None


def test_the_mlflow_run_points_to_the_prefect_flow_run(tmp_path, monkeypatch):
    assert flow_run_tags() == {}  # outside a flow run
    run_id = "0195a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__ID", run_id)  # Prefect's own way to stand in for a flow run
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "nightly-20261130-020000")
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api", PREFECT_UI_URL: "http://127.0.0.1:4200"}):
        tags = flow_run_tags()
    assert tags == {"prefect.flow_run_id": run_id, "prefect.flow_run_name": "nightly-20261130-020000",
                    "prefect.flow_run_url": f"http://127.0.0.1:4200/runs/flow-run/{run_id}"}
    with temporary_settings(restore_defaults={PREFECT_API_URL, PREFECT_UI_URL}):
        assert "prefect.flow_run_url" not in flow_run_tags()  # no server known: no link
    tracker = Tracker(_config(tmp_path))
    tracker.set_tags(tags)
    tracker.set_tags({"prefect.flow_run_id": "a-retry"})  # a resumed run points to the flow run resuming it
    logged = MlflowClient(tracking_uri=tracker.uri).get_run(tracker.run_id).data.tags
    assert (logged["prefect.flow_run_id"], logged["prefect.flow_run_url"]) == ("a-retry", tags["prefect.flow_run_url"])


def test_under_the_embedded_server_the_mlflow_link_is_the_printed_one_a_user_can_open(tmp_path, monkeypatch, capsys):
    """Issue 41, item 5: the quickstart's prefect.flow_run_url pointed at the embedded server's random port
    (http://127.0.0.1:33231/...), gone once the run ends; the printed URL (after `prefect server start` with the same
    PREFECT_HOME) uses 4200. A real embedded server and a flow run tag a real MLflow run, as start_run does."""
    from prefect import flow

    from flows.runtime.launcher import flow_run_page, prefect_server, using_prefect_api
    from flows.tools.cli import _print_where_to_look

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    home = tmp_path / "prefect"
    config = _config(tmp_path)
    tracker = Tracker(config)

    @flow(name="tagged")
    def tagged() -> dict:
        tags = flow_run_tags()
        tracker.set_tags(tags)
        return tags

    with prefect_server(prefect_home=home) as api_url, using_prefect_api(api_url, prefect_home=home):
        state = tagged(return_state=True)
        tags = state.result()
    flow_run_id = str(state.state_details.flow_run_id)
    logged = MlflowClient(tracking_uri=tracker.uri).get_run(tracker.run_id).data.tags["prefect.flow_run_url"]
    assert logged == tags["prefect.flow_run_url"] == f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id}"
    assert api_url.split(":")[2].split("/")[0] not in logged  # not the embedded server's port
    assert flow_run_page(flow_run_id) == logged
    _print_where_to_look(config, {"run_dir": "runs/exp-a", "mlflow_run_id": tracker.run_id}, flow_run_id)
    printed = capsys.readouterr().out.splitlines()
    assert f"               then {logged}" in printed
    # A server of the user's (PREFECT_API_URL set): the link is its UI's, printed as it is tagged.
    monkeypatch.setenv("PREFECT_API_URL", "http://head:4200/api")
    with temporary_settings(updates={PREFECT_API_URL: "http://head:4200/api"}):  # as Prefect read it at the start
        assert flow_run_page(flow_run_id) == f"http://head:4200/runs/flow-run/{flow_run_id}"


def test_lineage_is_logged_as_params_and_in_full_as_an_artifact(tmp_path):
    files = [{"path": f"/data/nightly/{day:02d}.parquet", "size": 1000 + day, "modified": f"2026-11-{day:02d}T02:00:00+00:00"}
             for day in range(1, 3)]
    lineage = {"data": {"train_files": files, "val_files": [{"path": "s3://key:secret@bucket/val.parquet", "size": 7,
                                                             "modified": None}]},
               "from_run": {"run": "quickstart-main", "step": 200, "weights": "/runs/quickstart-main/weights/actor/200"}}
    params = lineage_params(lineage)
    assert params == {
        "lineage.data.train_files": "/data/nightly/01.parquet (1001 bytes, 2026-11-01T02:00:00+00:00); "
                                    "/data/nightly/02.parquet (1002 bytes, 2026-11-02T02:00:00+00:00)",
        "lineage.data.train_files.count": "2", "lineage.data.train_files.bytes": "2003",
        "lineage.data.val_files": "s3://***@bucket/val.parquet (7 bytes, None)",
        "lineage.data.val_files.count": "1", "lineage.data.val_files.bytes": "7",
        "lineage.from_run": "quickstart-main", "lineage.from_run.step": "200"}
    assert "lineage.from_run" not in lineage_params({**lineage, "from_run": None})
    many = [{"path": f"/data/nightly/{index:05d}.parquet", "size": 1, "modified": None} for index in range(500)]
    cut = lineage_params({"data": {"train_files": many}})["lineage.data.train_files"]
    assert len(cut) == MAX_PARAM_LENGTH and cut.endswith(" ... (500 files; lineage.json lists them all)")

    tracker = Tracker(_config(tmp_path))
    tracker.log_lineage(lineage)
    client = MlflowClient(tracking_uri=tracker.uri)
    logged = client.get_run(tracker.run_id).data.params
    assert {key: logged[key] for key in params} == params
    with open(client.download_artifacts(tracker.run_id, LINEAGE_FILE, str(tmp_path / "download"))) as handle:
        recorded = json.load(handle)
    assert recorded["data"]["train_files"] == files and recorded["from_run"]["step"] == 200
    assert recorded["data"]["val_files"][0]["path"] == "s3://***@bucket/val.parquet"
