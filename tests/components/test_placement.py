"""Placement: config validation, memory estimates by hand, and every rule on constructed inventories."""

from __future__ import annotations

import os

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from components.devices import GpuInfo, GpuProcess, Inventory
from components.placement import (
    GIB,
    PlacementConfig,
    PlacementReport,
    check_distributed_env,
    count_parameters,
    describe_memory_basis,
    estimate_role_bytes,
    resolve_assignments,
    role_requirements,
    validate_placement,
)

MIB = 1024**2
H200_BYTES = 143771 * MIB  # 140.4 GiB, as nvidia-smi reports an H200
A100_BYTES = 81920 * MIB  # 80.0 GiB
NO_ENV: dict[str, str] = {}


def gpu(index: int, physical: int, name: str = "NVIDIA H200", total: int = H200_BYTES, used: int = 0,
        processes: list[GpuProcess] | None = None) -> GpuInfo:
    return GpuInfo(index=index, physical_index=physical, uuid=f"GPU-{physical}", name=name, total_bytes=total,
                   used_bytes=used, processes=processes or [])


def inventory(*gpus: GpuInfo, visible: str | None = None) -> Inventory:
    return Inventory(gpus=list(gpus), cuda_visible_devices=visible, source="nvml", torch_device_count=len(gpus))


TWO_OF_EIGHT = inventory(gpu(0, 4), gpu(1, 5), visible="4,5")
NO_GPU = inventory()


# --- the config --------------------------------------------------------------------------------------


def test_defaults():
    placement = PlacementConfig()
    assert (placement.roles, placement.default, placement.colocate) == ({}, "auto", [])
    assert (placement.memory_margin_gib, placement.allow_busy_gpus) == (2.0, False)
    assert PlacementConfig(roles={"actor": [0, 1], "reward": "cpu"}, default=[1]).roles["reward"] == "cpu"


@pytest.mark.parametrize("fields, fragment", [
    ({"roles": {"policy": [0]}}, "unknown role 'policy'; valid roles: rollout, actor, critic, reference, reward"),
    ({"colocate": [["actor", "ref"]]}, "unknown role 'ref'; valid roles: rollout, actor, critic, reference, reward"),
    ({"roles": {"actor": [0, 1, 0]}}, "role actor: GPU index 0 is listed twice in [0, 1, 0]; list each GPU once"),
    ({"roles": {"actor": [-1]}}, "role actor: GPU index -1 is negative"),
    ({"roles": {"critic": []}}, "role critic: the GPU list is empty"),
    ({"default": [2, 2]}, "default: GPU index 2 is listed twice"),
    ({"memory_margin_gib": -1}, "greater than or equal to 0"),
    ({"rollout": [0]}, "Extra inputs are not permitted"),
])
def test_config_errors(fields, fragment):
    with pytest.raises(ValueError) as raised:
        PlacementConfig(**fields)
    assert fragment in str(raised.value)


def test_config_errors_name_the_field_when_nested_in_the_training_config():
    from flows.config import _format_validation_error

    class Wrapper(BaseModel):
        model_config = ConfigDict(extra="forbid")
        placement: PlacementConfig = PlacementConfig()

    with pytest.raises(ValidationError) as raised:
        Wrapper.model_validate({"placement": {"roles": {"policy": [0]}}})
    assert _format_validation_error(raised.value) == (
        "placement.roles: unknown role 'policy'; valid roles: rollout, actor, critic, reference, reward")


def test_assignment_is_validated_too():
    placement = PlacementConfig()
    with pytest.raises(ValueError, match="unknown role 'critc'"):
        placement.roles = {"critc": [0]}


# --- estimates -----------------------------------------------------------------------------------------


def test_estimate_by_hand():
    # 0.5e9 parameters, fp32 masters computing in bf16, trained: fp32 weights 2e9 + fp32 grads 2e9 + AdamW 4e9
    # + the bf16 compute copy 1e9 + 1 GiB
    assert estimate_role_bytes(500_000_000, 2, trainable=True) == 9_000_000_000 + GIB
    assert estimate_role_bytes(500_000_000, 2, trainable=False) == 1_000_000_000 + GIB
    # fp32 training needs no compute copy: 4e9 + 4e9 + 8e9 + 1 GiB
    assert estimate_role_bytes(1_000_000_000, 4, trainable=True) == 16_000_000_000 + GIB
    # pure bf16 (weights, grads and both moments in bf16): 8 bytes per parameter
    assert estimate_role_bytes(500_000_000, 2, trainable=True, master_bytes=2) == 4_000_000_000 + GIB
    assert estimate_role_bytes(0, 2, trainable=False) == GIB
    with pytest.raises(ValueError, match="compute_bytes=0"):
        estimate_role_bytes(10, 0, trainable=False)


def test_lora_estimate_counts_adamw_state_for_the_adapters_only():
    # 0.5e9 frozen base in bf16 (the compute dtype) 1e9 + 4.4e6 adapter parameters x 16 (fp32 weights, grads and
    # two moments) 70.4e6 + 1 GiB: about an eighth of full fine-tuning's 9e9
    assert estimate_role_bytes(500_000_000, 2, trainable=True, trained_parameters=4_400_000) == (
        1_000_000_000 + 70_400_000 + GIB)
    assert role_requirements({"actor": 500_000_000, "reference": 500_000_000}, 2,
                             trained_parameters={"actor": 4_400_000}) == {"actor": 1_070_400_000 + GIB,
                                                                          "reference": 1_000_000_000 + GIB}
    assert "16 per LoRA adapter parameter" in describe_memory_basis(2, 4, lora=True)


def test_adapter_parameters_are_counted_from_the_config(tmp_path):
    from components.lora import adapter_parameter_count
    from components.tiny import build_tiny_model

    path = str(build_tiny_model(tmp_path / "tiny"))  # hidden 128, intermediate 512, 2 layers
    # rank 8 on q, k, v, o (128 -> 128) and gate, up (128 -> 512), down (512 -> 128): 8 x (in + out) each
    per_layer = 4 * 8 * 256 + 3 * 8 * 640
    settings = dict(rank=8, alpha=16, dropout=0.0, target_modules="all-linear")
    assert adapter_parameter_count(path, settings) == 2 * per_layer
    assert adapter_parameter_count(path, dict(settings, target_modules=["q_proj", "v_proj"])) == 2 * 2 * 8 * 256


def test_requirements_shard_trainable_roles_over_their_gpus():
    assignments = {"actor": [0, 1], "reference": [0, 1], "critic": "cpu", "rollout": [0]}
    parameters = {role: 500_000_000 for role in assignments}
    assert role_requirements(parameters, 2, assignments) == {
        "actor": 4_500_000_000 + GIB,  # 9e9 of training state over 2 GPUs
        "reference": 1_000_000_000 + GIB,  # a whole copy on each GPU
        "critic": 9_000_000_000 + GIB,
        "rollout": 1_000_000_000 + GIB,
    }


def test_the_memory_basis_names_sixteen_bytes_per_trained_parameter_and_the_compute_copy():
    assert "16 bytes per parameter (fp32 weights, gradients and two AdamW moments) + 2 (16-bit compute copy)" \
        in describe_memory_basis(2, 4)
    assert "compute copy" not in describe_memory_basis(4, 4)
    assert "8 bytes per parameter (16-bit" in describe_memory_basis(2, 2)


def test_count_parameters_matches_the_real_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from components.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    real = sum(parameter.numel() for parameter in model.parameters())  # tied embeddings once
    assert model.config.tie_word_embeddings
    assert count_parameters(str(path)) == real
    embedding = model.get_input_embeddings().weight.numel()
    assert sum(tensor.numel() for tensor in model.state_dict().values()) == real + embedding


# --- resolution ------------------------------------------------------------------------------------------


def test_auto_default_with_and_without_gpus():
    placement = PlacementConfig(roles={"reward": "cpu"})
    assert resolve_assignments(placement, 2, ("rollout", "actor", "reward")) == {
        "rollout": [0], "actor": [0], "reward": "cpu"}
    assert resolve_assignments(placement, 0, ("rollout", "actor")) == {"rollout": "cpu", "actor": "cpu"}
    assert validate_placement(PlacementConfig(), NO_GPU, env=NO_ENV).assignments == {role: "cpu" for role in (
        "rollout", "actor", "critic", "reference", "reward")}


def test_modelless_roles_default_to_the_cpu():
    placement = PlacementConfig(roles={"actor": [0]})
    report = validate_placement(placement, TWO_OF_EIGHT, env=NO_ENV, roles_in_use=("actor", "reward"),
                                modelless_roles=("reward",))
    assert report.ok and report.assignments == {"actor": [0], "reward": "cpu"}
    placement.roles = {"actor": [0], "reward": [1]}  # listed explicitly: honoured
    assert resolve_assignments(placement, 2, ("actor", "reward"), ("reward",)) == {"actor": [0], "reward": [1]}


def test_default_placement_is_valid_on_one_gpu():
    report = validate_placement(PlacementConfig(), inventory(gpu(0, 0)), env=NO_ENV)
    assert report.ok, report.errors
    assert report.assignments["actor"] == [0]


# --- rule 1: indices within the visible GPUs ----------------------------------------------------------------


def test_index_out_of_range_names_visible_and_physical_ids():
    report = validate_placement(PlacementConfig(roles={"actor": [0, 3]}), TWO_OF_EIGHT, env=NO_ENV,
                                roles_in_use=("actor",))
    assert report.errors == ["placement.roles.actor: GPU index 3 is out of range: 2 GPUs are visible "
                             "(CUDA_VISIBLE_DEVICES=4,5 -> physical 4, 5); use indices 0-1"]
    assert not report.ok


def test_index_out_of_range_through_the_default():
    report = validate_placement(PlacementConfig(default=[2]), inventory(gpu(0, 0)), env=NO_ENV,
                                roles_in_use=("actor",))
    assert report.errors == ["placement.default (used by actor): GPU index 2 is out of range: 1 GPU is visible "
                             "(CUDA_VISIBLE_DEVICES unset -> physical 0); use index 0"]


def test_any_gpu_without_visible_gpus_says_use_cpu():
    report = validate_placement(PlacementConfig(roles={"actor": [0]}), inventory(visible=""), env=NO_ENV,
                                roles_in_use=("actor",))
    assert report.errors == ['placement.roles.actor: GPU index 0 is out of range: no GPU is visible '
                             '(CUDA_VISIBLE_DEVICES=); use "cpu"']
    report = validate_placement(PlacementConfig(roles={"actor": [1]}), NO_GPU, env=NO_ENV, roles_in_use=("actor",))
    assert "no GPU is visible (CUDA_VISIBLE_DEVICES unset, no NVIDIA GPU found); use \"cpu\"" in report.errors[0]


# --- rule 2: sharing only inside a colocate group -----------------------------------------------------------


def test_two_roles_on_one_gpu_are_refused_without_colocation():
    placement = PlacementConfig(roles={"actor": [0], "critic": [0, 1]})
    report = validate_placement(placement, TWO_OF_EIGHT, env=NO_ENV, roles_in_use=("actor", "critic"))
    assert report.errors == [
        "placement.roles.actor and placement.roles.critic both use GPU 0 (physical 4, NVIDIA H200), and no "
        "placement.colocate group holds both; move one to another GPU or add [actor, critic] to placement.colocate"]


def test_colocated_roles_may_share():
    placement = PlacementConfig(roles={"actor": [0], "critic": [0, 1]}, colocate=[["critic", "actor"]])
    assert validate_placement(placement, TWO_OF_EIGHT, env=NO_ENV, roles_in_use=("actor", "critic")).ok


def test_an_explicit_role_may_not_share_the_default_gpu_unless_colocated():
    placement = PlacementConfig(roles={"actor": [0]})  # rollout and reference follow auto -> [0]
    report = validate_placement(placement, TWO_OF_EIGHT, env=NO_ENV, roles_in_use=("rollout", "actor", "reference"))
    assert len(report.errors) == 2
    assert report.errors[0].startswith("placement.default (used by rollout) and placement.roles.actor both use GPU 0")
    placement.colocate = [["rollout", "actor", "reference"]]
    assert validate_placement(placement, TWO_OF_EIGHT, env=NO_ENV,
                              roles_in_use=("rollout", "actor", "reference")).ok


def test_roles_not_in_use_are_ignored():
    placement = PlacementConfig(roles={"actor": [0], "critic": [0, 7]})
    report = validate_placement(placement, TWO_OF_EIGHT, env=NO_ENV, roles_in_use=("rollout", "actor"))
    assert "critic" not in report.assignments
    assert report.errors == [error for error in report.errors if "critic" not in error]


# --- rule 3: free memory ----------------------------------------------------------------------------------------


def test_memory_of_a_gpu_half_held_by_another_process():
    busy = gpu(0, 4, used=60 * GIB, processes=[GpuProcess(pid=4242, name="python3", used_bytes=60 * GIB)])
    placement = PlacementConfig(roles={"actor": [0], "reference": [0]}, colocate=[["actor", "reference"]],
                                allow_busy_gpus=True)
    requirements = {"actor": 70 * GIB, "reference": 10 * GIB}
    report = validate_placement(placement, inventory(busy, visible="4"), requirements, env=NO_ENV,
                                roles_in_use=("actor", "reference"))
    assert report.errors == [
        "placement.roles.actor, placement.roles.reference: GPU 0 (physical 4, NVIDIA H200) has 80.4 GiB free of "
        "140.4 GiB but needs 82.0 GiB (actor 70.0 GiB + reference 10.0 GiB + margin 2 GiB); spread the roles "
        "over more GPUs"]
    placement.memory_margin_gib = 0.0
    assert validate_placement(placement, inventory(busy, visible="4"), requirements, env=NO_ENV,
                              roles_in_use=("actor", "reference")).ok


def test_memory_check_needs_requirements_and_skips_unknown_roles():
    small = gpu(0, 0, total=4 * GIB)
    placement = PlacementConfig(roles={"actor": [0], "reference": [0]}, colocate=[["actor", "reference"]])
    roles = ("actor", "reference")
    assert validate_placement(placement, inventory(small), None, env=NO_ENV, roles_in_use=roles).ok
    assert validate_placement(placement, inventory(small), {"actor": GIB}, env=NO_ENV, roles_in_use=roles).ok
    report = validate_placement(placement, inventory(small), {"actor": 3 * GIB}, env=NO_ENV, roles_in_use=roles)
    assert "has 4.0 GiB free of 4.0 GiB but needs 5.0 GiB (actor 3.0 GiB + margin 2 GiB)" in report.errors[0]


# --- rule 4: other processes ----------------------------------------------------------------------------------


def test_busy_gpu_is_an_error_or_with_allow_busy_gpus_a_warning():
    busy = gpu(1, 5, used=61 * GIB, processes=[GpuProcess(pid=4242, name="python3", used_bytes=60 * GIB),
                                                 GpuProcess(pid=77, name="?", used_bytes=GIB)])
    gpus = inventory(gpu(0, 4), busy, visible="4,5")
    message = ("placement.roles.critic: GPU 1 (physical 5, NVIDIA H200) is busy: pid 4242 python3 (60.0 GiB), "
               "pid 77 ? (1.0 GiB)")
    placement = PlacementConfig(roles={"critic": [1]})
    report = validate_placement(placement, gpus, env=NO_ENV, roles_in_use=("critic",))
    assert report.errors == [message + "; free it, pick another GPU, or set placement.allow_busy_gpus=true"]
    placement.allow_busy_gpus = True
    report = validate_placement(placement, gpus, env=NO_ENV, roles_in_use=("critic",))
    assert report.ok
    assert report.warnings == [message + "; accepted (placement.allow_busy_gpus=true)"]


def test_this_process_does_not_count_as_another():
    mine = gpu(0, 0, used=GIB, processes=[GpuProcess(pid=os.getpid(), name="python", used_bytes=GIB)])
    assert validate_placement(PlacementConfig(), inventory(mine), env=NO_ENV).ok


# --- rule 5: one kind of GPU per role ---------------------------------------------------------------------------


def test_mixed_gpus_in_one_role_warn():
    mixed = inventory(gpu(0, 0, name="NVIDIA A100-SXM4-80GB", total=A100_BYTES), gpu(1, 1))
    report = validate_placement(PlacementConfig(roles={"actor": [0, 1], "rollout": [1]}), mixed, env=NO_ENV,
                                roles_in_use=("actor", "rollout"))
    assert report.warnings == [
        "placement.roles.actor: mixed GPUs: GPU 0 (physical 0, NVIDIA A100-SXM4-80GB) 80.0 GiB, GPU 1 (physical 1, "
        "NVIDIA H200) 140.4 GiB; sharded work runs at the pace of the slowest and fits the smallest"]
    assert len(report.errors) == 1 and "rollout" in report.errors[0]  # actor and rollout share GPU 1


# --- rule 6: the distributed environment ---------------------------------------------------------------------------


def test_a_complete_torchrun_environment_passes():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "NNODES": "2",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert check_distributed_env(env) == []
    assert check_distributed_env({}) == []


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "0"}, "distributed env: RANK=0 is set but WORLD_SIZE is not; set them together (torchrun does) "
                    "or unset RANK"),
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "distributed env: RANK=4 must be < WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "distributed env: LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "NNODES": "2",
      "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "distributed env: WORLD_SIZE=8 != NNODES=2 x LOCAL_WORLD_SIZE=2"),
    ({"RANK": "zero", "WORLD_SIZE": "1"}, "distributed env: RANK='zero' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "distributed env: WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not "
                                       "both set; the ranks cannot meet"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "distributed env: WORLD_SIZE=0 must be >= 1"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, "distributed env: LOCAL_RANK=0 is set but RANK is not"),
])
def test_distributed_env_errors(env, expected):
    errors = check_distributed_env(env)
    assert any(error.startswith(expected) for error in errors), errors


def test_distributed_errors_reach_the_report():
    report = validate_placement(PlacementConfig(), NO_GPU, env={"WORLD_SIZE": "2"})
    assert report.errors[0].startswith("distributed env: WORLD_SIZE=2 is set but RANK is not")


# --- the report -----------------------------------------------------------------------------------------------


def test_raise_if_failed_joins_one_line_per_error():
    PlacementReport(assignments={}).raise_if_failed()
    report = PlacementReport(assignments={}, errors=["first problem", "second problem"], warnings=["just so"])
    assert not report.ok
    with pytest.raises(ValueError) as raised:
        report.raise_if_failed()
    assert str(raised.value) == "first problem\nsecond problem"
