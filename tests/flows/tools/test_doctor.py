"""flows.tools.doctor: `rlhf doctor` on this GPU-less machine, and with a constructed 2-GPU inventory for placement errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from components.devices import GpuInfo, GpuProcess, Inventory
from flows.tools import doctor
from flows.config import build_config
from flows.runtime.launcher import free_port

GIB = 1024**3
REPO = Path(__file__).resolve().parents[3]
WORKERS = "trainer.execution=workers"  # the placement applies only to role workers


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny model, and beside it (data/) the arithmetic prompts the configs of `overrides` read."""
    from components.tasks.arithmetic import write_arithmetic_dataset
    from components.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    write_arithmetic_dataset(root / "data", train_size=64, validation_size=16)
    return str(build_tiny_model(root / "tiny"))


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """No Prefect server configured, a private Prefect home, and the working folder in tmp_path."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    for name in doctor.DISTRIBUTED_ENV + ("GROUP_RANK",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def overrides(tmp_path, tiny_model: str) -> list[str]:
    data = Path(tiny_model).parent / "data"
    return [f"run.storage_root={tmp_path / 'runs'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow' / 'db'}",
            f"model.path={tiny_model}", f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'validation.parquet'}]"]


def two_h200(processes: list[GpuProcess] | None = None) -> Inventory:
    gpus = [GpuInfo(index=index, physical_index=physical, uuid=f"GPU-{physical}", name="NVIDIA H200",
                    total_bytes=143771 * 1024**2, used_bytes=0, processes=[], pci_bus_id=f"00000000:0{physical}:00.0")
            for index, physical in enumerate((4, 5))]
    gpus[1].processes = processes or []
    gpus[1].used_bytes = sum(process.used_bytes for process in gpus[1].processes)
    return Inventory(gpus=gpus, cuda_visible_devices="4,5", source="nvml", torch_device_count=2,
                     interconnect=[["X", "NV18"], ["NV18", "X"]])


def namespace(*arguments: str, json_output: bool = False) -> argparse.Namespace:
    config = arguments[0] if arguments else None
    return argparse.Namespace(config=config, overrides=list(arguments[1:]), json=json_output)


# --- this machine -------------------------------------------------------------------------------------------


def test_report_without_config_on_this_machine(machine):
    report = doctor.collect_report(None)
    assert not report["failed"] and not doctor.report_failed(report)
    assert report["prefect"] == {"status": "ok", "detail": "not set: runs start a local server", "url": None}
    assert report["storage"]["status"] == "ok" and (machine / ".rlhf" / "runs").is_dir()
    assert list((machine / ".rlhf" / "runs").iterdir()) == []  # the probe file is gone
    assert report["tracking"]["status"] == "ok"
    assert report["placement"]["status"] == "skip"
    assert set(report["versions"]) == {"python", "torch", "transformers", "vllm", "prefect", "mlflow", "flash_attn",
                                       "pyarrow", "nvidia-ml-py"}
    assert set(report["distributed_env"]) == {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                              "MASTER_PORT", "NNODES"}
    assert json.loads(json.dumps(report)) == report


def test_text_on_a_machine_without_gpus(machine, tiny_model, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system",
                        lambda env: Inventory(gpus=[], cuda_visible_devices=None, source="none", torch_device_count=0,
                                              note="no NVIDIA GPU found"))
    report = doctor.collect_report(build_config(None, overrides(machine, tiny_model)))
    text = doctor.format_report(report)
    assert "no GPU visible: roles run on the CPU" in text
    assert "ok    Prefect API   not set: runs start a local server" in text
    assert "ok    storage root" in text and "ok    MLflow" in text
    assert report["placement"]["assignments"] == {"rollout": "cpu", "actor": "cpu", "reward": "cpu"}
    assert report["placement"]["status"] == "ok"
    assert report["inputs"] == {"status": "ok", "detail": "model, data, reward and where the run writes check out",
                                "errors": [], "lines": ["data: 64 training prompts, 16 validation prompts",
                                                        "reward: data_source 'arithmetic' scored by exact_match"]}
    assert "Run inputs\n  ok    model, data, reward and where the run writes check out\n" in text
    assert text.splitlines()[-1] == "ok: nothing would fail"


def test_prefect_url_that_does_not_answer_fails(machine, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    report = doctor.collect_report(None)
    assert report["prefect"]["status"] == "fail"
    assert report["failed"]
    assert "FAIL  Prefect API   GET http://127.0.0.1:" in doctor.format_report(report)
    assert doctor.format_report(report).splitlines()[-1] == "FAIL: prefect (see the FAIL lines)"


def test_tracking_and_storage_that_cannot_be_written_fail(machine):
    blocker = machine / "a-file"
    blocker.write_text("not a folder")
    tracking = doctor.check_tracking(f"sqlite:///{blocker}/mlflow.db")
    assert tracking["status"] == "fail" and f"{blocker} is not a folder" in tracking["detail"]
    storage = doctor.check_storage(str(blocker / "runs"))
    assert storage["status"] == "fail" and storage["detail"].startswith(f"{blocker / 'runs'}: cannot write there")
    assert doctor.check_tracking(f"http://127.0.0.1:{free_port()}")["status"] == "fail"
    assert doctor.check_tracking("postgresql://db/mlflow")["status"] == "warn"
    assert doctor.check_tracking(f"sqlite:///{machine}/new/folder/mlflow.db")["detail"].endswith("can be created")


# --- placement with a constructed inventory -----------------------------------------------------------------


def test_placement_error_shows_up_and_fails(machine, tiny_model, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: two_h200())
    config = build_config(None, overrides(machine, tiny_model) + [WORKERS, "placement.roles.actor=[5]"])
    report = doctor.collect_report(config)
    assert report["failed"]
    assert report["placement"]["errors"][0] == (
        "placement.roles.actor: GPU index 5 is out of range: 2 GPUs are visible (CUDA_VISIBLE_DEVICES=4,5 -> "
        "physical 4, 5); use indices 0-1")
    text = doctor.format_report(report)
    assert "FAIL  placement.roles.actor: GPU index 5 is out of range" in text
    assert "GPU 1 (physical 5)  NVIDIA H200  0.0 / 140.4 GiB used" in text
    assert "  GPU0  X      NV18\n" in text and "CUDA_VISIBLE_DEVICES  4,5\n" in text
    assert text.splitlines()[-1] == "FAIL: placement (see the FAIL lines)"


def test_placement_on_two_gpus_with_estimates(machine, tiny_model, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system",
                        lambda env: two_h200([GpuProcess(pid=4242, name="python3", used_bytes=60 * GIB)]))
    config = build_config(None, overrides(machine, tiny_model) + [
        WORKERS, "actor.use_kl_loss=true", "placement.roles.actor=[1]", "placement.default=[0]"])
    report = doctor.collect_report(config)
    placement = report["placement"]
    assert set(placement["roles_in_use"]) == {"rollout", "actor", "reference", "reward"}
    # a rule reward loads no model: it stays on the CPU
    assert placement["assignments"] == {"rollout": [0], "actor": [1], "reference": [0], "reward": "cpu"}
    assert placement["parameters"] == {"rollout": 558976, "actor": 558976, "reference": 558976}
    # fp32 actor: 558976 * (4 + 4 + 8) bytes + 1 GiB
    assert placement["requirements_gib"]["actor"] == round((558976 * 16 + GIB) / GIB, 2)
    assert placement["errors"] == [
        "placement.roles.actor: GPU 1 (physical 5, NVIDIA H200) is busy: pid 4242 python3 (60.0 GiB); free it, "
        "pick another GPU, or set placement.allow_busy_gpus=true"]
    assert "other process: pid 4242 python3 60.0 GiB" in doctor.format_report(report)
    # bf16 compute keeps fp32 masters: 16 bytes per trained parameter plus the bf16 compute copy, and says so
    config = build_config(None, overrides(machine, tiny_model) + [
        WORKERS, "actor.use_kl_loss=true", "placement.roles.actor=[1]", "placement.default=[0]",
        "model.compute_dtype=bfloat16"])
    report = doctor.collect_report(config)
    assert report["placement"]["requirements_gib"]["actor"] == round((558976 * (16 + 2) + GIB) / GIB, 2)
    assert report["placement"]["requirements_gib"]["reference"] == round((558976 * 2 + GIB) / GIB, 2)
    assert "trained roles 16 bytes per parameter (fp32 weights, gradients and two AdamW moments) + 2 (16-bit " \
           "compute copy)" in doctor.format_report(report)


def test_a_lora_runs_reference_is_the_actors_model_and_counts_no_memory_or_gpu(machine, tiny_model, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: two_h200())
    config = build_config(None, overrides(machine, tiny_model) + [
        WORKERS, "actor.use_kl_loss=true", "model.lora_rank=4", "placement.roles.actor=[1]", "placement.default=[0]"])
    report = doctor.collect_report(config)
    placement = report["placement"]
    assert placement["status"] == "ok", placement
    assert placement["roles_in_use"] == ["rollout", "actor", "reward"]
    assert placement["assignments"] == {"rollout": [0], "actor": [1], "reward": "cpu"}
    assert set(placement["parameters"]) == set(placement["requirements_gib"]) == {"rollout", "actor"}
    assert ("        reference  the actor's model with its adapter disabled (model.lora_rank=4), in the actor's worker: "
            "no GPU or memory of its own") in doctor.format_report(report).splitlines()


def test_a_model_that_cannot_be_counted_skips_its_memory_check(machine, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: two_h200())
    config = build_config(None, overrides(machine, str(machine / "no-model")))
    placement = doctor.collect_report(config)["placement"]
    assert placement["status"] == "warn" and placement["parameters"] == {}
    assert placement["notes"][0] == (
        f"could not count the parameters of rollout ({machine / 'no-model'}): model.path='{machine / 'no-model'}' "
        "does not exist; give a local model folder or a Hugging Face hub name (`rlhf make-tiny-model DIR` writes a "
        "tiny one); its memory check is skipped")  # not the hub's `Repo id must be in the form ...`
    assert placement["assignments"] == {"rollout": [0], "actor": [0], "reward": "cpu"}


# --- the command ----------------------------------------------------------------------------------------------


def test_cmd_doctor_exit_codes_and_json(machine, tiny_model, capsys, monkeypatch):
    assert doctor.cmd_doctor(namespace(*overrides(machine, tiny_model), json_output=True)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["placement"]["status"] == "ok" and report["failed"] is False
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    assert doctor.cmd_doctor(namespace()) == 1
    assert "FAIL  Prefect API" in capsys.readouterr().out


def test_cmd_doctor_fails_on_a_placement_error(machine, tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: two_h200())
    config_file = machine / "config.yaml"
    config_file.write_text("trainer:\n  execution: workers\n")
    arguments = namespace(str(config_file), *overrides(machine, tiny_model), "placement.roles.actor=[5]")
    assert doctor.cmd_doctor(arguments) == 1
    assert "FAIL  placement.roles.actor: GPU index 5 is out of range" in capsys.readouterr().out


def test_placement_errors_only_warn_under_local_execution(machine, tiny_model, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: two_h200())
    config = build_config(None, overrides(machine, tiny_model) + ["placement.roles.actor=[5]"])
    report = doctor.collect_report(config)
    assert report["placement"]["status"] == "warn" and not report["failed"]
    text = doctor.format_report(report)
    assert "warn  placement.roles.actor: GPU index 5 is out of range" in text
    assert "trainer.execution=local: roles run in one process on trainer.device" in text


def test_parser_help_and_arguments():
    parser = argparse.ArgumentParser(prog="rlhf")
    doctor.add_doctor_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", "configs/quickstart.yaml", "trainer.total_steps=3", "--json"])
    assert (args.config, args.overrides, args.json, args.handler) == (
        "configs/quickstart.yaml", ["trainer.total_steps=3"], True, doctor.cmd_doctor)
    assert parser.parse_args(["doctor"]).config is None
    help_text = parser._subparsers._group_actions[0].choices["doctor"].format_help()
    assert help_text.startswith("usage: rlhf doctor") and "example: rlhf doctor" in help_text


def test_a_placement_entry_for_a_lora_runs_reference_is_named_as_unused(tmp_path):
    """configs/gpu-2x.yaml places the reference on GPU 1; with LoRA it is the actor's model (no GPU of its own), so
    the entry does nothing: one warning says so, and nothing is refused (the layout stays valid for full tuning)."""
    from flows.config import load_config
    from flows.training.plan import placement_verdict

    machine = two_h200()
    counts = {"rollout": 500_000_000, "actor": 500_000_000, "critic": 500_000_000, "reference": 500_000_000,
              "reward": 0}

    def verdict(*overrides):
        config = load_config(str(REPO / "configs" / "gpu-2x.yaml"), [f"run.storage_root={tmp_path}", "model.path=m",
                                                     "actor.use_kl_loss=true", *overrides])
        return placement_verdict(config, machine, {}, {role: counts[role] for role in config.roles})[1]

    lora = verdict("model.lora_rank=32")
    unused = [line for line in lora.warnings if line.startswith("placement.roles.reference")]
    assert unused == ["placement.roles.reference=[1] is not used: reference is the actor's model with its adapter "
                      "disabled (model.lora_rank=32), in the actor's worker: no GPU or memory of its own; drop the "
                      "entry (or set model.lora_rank=0 for a reference model of its own)"], lora.warnings
    assert lora.errors == []
    full = verdict()
    assert not [line for line in full.warnings if "is not used" in line] and full.errors == []


# --- the four-GPU reference layout (configs/gpu-4x.yaml), against a constructed 4 x H200 machine -----------


def four_h200() -> Inventory:
    gpus = [GpuInfo(index=index, physical_index=index, uuid=f"GPU-{index}", name="NVIDIA H200",
                    total_bytes=143771 * 1024**2, used_bytes=0, processes=[], pci_bus_id=f"00000000:0{index}:00.0")
            for index in range(4)]
    return Inventory(gpus=gpus, cuda_visible_devices=None, source="nvml", torch_device_count=4)


@pytest.fixture(scope="module")
def shaped_models(tmp_path_factory):
    """Config-only folders of the 1.5B and 0.5B shapes: enough to count parameters, nothing to load."""
    from components.tiny import PRESETS, tiny_config

    root = tmp_path_factory.mktemp("shaped")
    for preset in ("qwen2.5-1.5b", "qwen2.5-0.5b"):
        tiny_config(PRESETS[preset]).save_pretrained(root / preset)
    return root


def gpu_4x(machine, shaped_models, *extra: str):
    from flows.config import load_config

    return load_config(str(REPO / "configs" / "gpu-4x.yaml"), [
        f"run.storage_root={machine / 'runs'}", f"tracking.tracking_uri=sqlite:///{machine / 'mlflow.db'}",
        f"model.path={shaped_models / 'qwen2.5-1.5b'}", f"critic.model_path={shaped_models / 'qwen2.5-0.5b'}",
        f"reward.model_path={shaped_models / 'qwen2.5-0.5b'}", *extra])


def test_reference_four_gpu_layout_validates(machine, shaped_models, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: four_h200())
    placement = doctor.collect_report(gpu_4x(machine, shaped_models))["placement"]
    assert placement["errors"] == []
    assert placement["assignments"] == {"rollout": [0], "actor": [0, 1], "reward": [3], "reference": [1],
                                        "critic": [2]}
    parameters = placement["parameters"]
    assert 1.5e9 < parameters["actor"] < 1.6e9  # the 1.5B shape (rollout and reference too)
    assert 0.48e9 < parameters["critic"] < 0.5e9 and 0.48e9 < parameters["reward"] < 0.5e9  # 0.5B shapes


def test_wrong_four_gpu_placements_fail_before_anything_loads(machine, shaped_models, monkeypatch):
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: four_h200())
    errors = doctor.collect_report(gpu_4x(machine, shaped_models, "placement.roles.critic=[4]"))["placement"]["errors"]
    assert errors == ["placement.roles.critic: GPU index 4 is out of range: 4 GPUs are visible "
                      "(CUDA_VISIBLE_DEVICES unset -> physical 0, 1, 2, 3); use indices 0-3"]
    errors = doctor.collect_report(gpu_4x(machine, shaped_models, "placement.roles.critic=[0]"))["placement"]["errors"]
    assert ("placement.roles.actor and placement.roles.critic both use GPU 0 (physical 0, NVIDIA H200), and no "
            "placement.colocate group holds both; move one to another GPU or add [actor, critic] to "
            "placement.colocate") in errors


def test_doctor_says_how_weights_reach_the_rollout(machine, tiny_model, shaped_models):
    local = doctor.collect_report(build_config(None, overrides(machine, tiny_model) + ["rollout.engine=hf"]))
    assert local["weight_sync"] == {
        "mode": "memory", "detail": "in memory from the actor's live model, tensor by tensor into the transformers "
                                    "engine; a copy is stored in the background for every 1 steps (checkpoints) "
                                    "and the last"}
    assert "weight sync memory: in memory from the actor's live model" in doctor.format_report(local)
    stored = doctor.collect_report(build_config(None, overrides(machine, tiny_model) + [
        "rollout.engine=hf", "trainer.weight_sync=storage"]))["weight_sync"]
    assert stored["mode"] == "storage" and stored["detail"].startswith("through storage (trainer.weight_sync=storage)")
    # The reference 4-GPU layout: the rollout beside the actor's rank 0 on GPU 0, in workers of their own.
    workers = doctor.weight_sync_report(gpu_4x(machine, shaped_models), "vllm", "on GPU [0]",
                                        {"actor": [0, 1], "rollout": [0], "critic": [2]})
    assert workers["mode"] == "memory" and workers["detail"].startswith(
        "in memory from the actor's live model, over CUDA IPC from the actor's worker to the rollout's (both see "
        "GPU 0: no copy through the host), in buckets of 512 MiB; workers on other hosts: NCCL")
    apart = doctor.weight_sync_report(gpu_4x(machine, shaped_models), "vllm", "on GPU [2, 3]",
                                      {"actor": [0, 1], "rollout": [2, 3]})
    assert "over NCCL from the actor's worker (GPU 0) to the rollout's (GPUs [2, 3])" in apart["detail"]
    on_cpu = doctor.collect_report(build_config(None, overrides(machine, tiny_model) + [
        "rollout.engine=hf", "trainer.execution=workers", "placement.default=cpu"]))["weight_sync"]
    assert "over a gloo group (CPU) from the actor's worker to the rollout's" in on_cpu["detail"]
    gpu = doctor.weight_sync_report(build_config(None, ["rollout.update_weights_bucket_megabytes=256"]), "vllm",
                                    "vllm 0.32.0 on GPU [0], tensor parallel 1, sleeps between generations")
    assert "over CUDA IPC to vLLM's workers, in buckets of 256 MiB" in gpu["detail"]


def test_doctor_names_the_rollout_engine(machine, tiny_model, shaped_models, monkeypatch):
    from components.vllm_build import vllm_supports

    report = doctor.collect_report(build_config(None, overrides(machine, tiny_model) + ["trainer.device=cpu"]))
    expected = "vllm" if vllm_supports("cpu") else "hf"
    assert report["rollout"]["engine"] == expected
    assert f"rollout engine {expected}: " in doctor.format_report(report)
    hf = doctor.collect_report(build_config(None, overrides(machine, tiny_model) + ["rollout.engine=hf"]))
    assert hf["rollout"] == {"engine": "hf", "detail": "transformers generate on cpu (rollout.engine=hf)"}
    # The reference 4-GPU layout: the rollout shares GPU 0 with the actor, so a vLLM engine would sleep.
    monkeypatch.setattr(doctor, "inventory_from_system", lambda env: four_h200())
    # The CUDA build of vLLM, patched where its names are used (the modules import them at the top).
    monkeypatch.setattr("flows.training.engines.installed_vllm", lambda: "vllm")
    monkeypatch.setattr("flows.training.engines.vllm_supports", lambda device: device == "cuda")
    monkeypatch.setattr("flows.training.plan.installed_vllm", lambda: "vllm")
    monkeypatch.setattr("flows.tools.doctor_run.vllm_version", lambda: "vllm 0.26.0")
    four = doctor.collect_report(gpu_4x(machine, shaped_models))["rollout"]
    assert four == {"engine": "vllm",
                    "detail": "vllm 0.26.0 on GPU [0], tensor parallel 1, sleeps between generations"}
    # The rollout on GPUs 0-1 with two engines: one GPU each (as the rollout builds them), not tensor parallel 2.
    two = doctor.collect_report(gpu_4x(machine, shaped_models, "placement.roles.rollout=[0,1]",
                                       "rollout.engines=2"))["rollout"]
    assert two["detail"] == "vllm 0.26.0 on GPU [0, 1], 2 engines, each tensor parallel 1, sleeps between generations"


def test_prefect_authentication_is_checked_against_a_real_server(machine, monkeypatch):
    """A real Prefect server started with PREFECT_SERVER_API_AUTH_STRING: doctor fails without the client's
    PREFECT_API_AUTH_STRING or with a wrong one, and is ok with the right one. Then a server without
    authentication: ok on loopback, a warning where other hosts could reach it (is_loopback patched: tests
    send traffic to loopback addresses only)."""
    from flows.runtime.launcher import prefect_server

    monkeypatch.setenv("PREFECT_SERVER_API_AUTH_STRING", "rlhf:s3cret")
    with prefect_server(machine / "prefect-auth") as url:
        without = doctor.check_prefect({"PREFECT_API_URL": url})
        assert without["status"] == "fail"
        assert without["detail"].endswith("the API asks for authentication (HTTP 401) and PREFECT_API_AUTH_STRING is "
                                          "not set: set it to the server's PREFECT_SERVER_API_AUTH_STRING")
        wrong = doctor.check_prefect({"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": "rlhf:guess"})
        assert wrong["status"] == "fail" and "PREFECT_API_AUTH_STRING is refused (HTTP 401)" in wrong["detail"]
        right = doctor.check_prefect({"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": "rlhf:s3cret"})
        assert right["status"] == "ok" and right["detail"].endswith("authenticated (PREFECT_API_AUTH_STRING accepted)")
    monkeypatch.delenv("PREFECT_SERVER_API_AUTH_STRING")
    with prefect_server(machine / "prefect-open") as url:
        loopback = doctor.check_prefect({"PREFECT_API_URL": url})
        assert loopback["status"] == "ok" and loopback["detail"].endswith("no authentication (loopback only)")
        monkeypatch.setattr(doctor, "is_loopback", lambda url: False)
        exposed = doctor.check_prefect({"PREFECT_API_URL": url})
        assert exposed["status"] == "warn" and "answers without authentication on a non-loopback address" in \
            exposed["detail"]
        report = doctor.collect_report(None, env={"PREFECT_API_URL": url})
        assert not report["failed"] and "warn  Prefect API" in doctor.format_report(report)


def test_loopback_addresses():
    assert doctor.is_loopback("http://127.0.0.1:4200/api") and doctor.is_loopback("http://localhost:4200/api")
    assert doctor.is_loopback("http://127.8.9.10/api") and doctor.is_loopback("http://[::1]:4200/api")
    assert not doctor.is_loopback("http://0.0.0.0:4200/api") and not doctor.is_loopback("http://10.1.2.3:4200/api")
    assert not doctor.is_loopback("http://head-node:4200/api")
