"""Explicit placement of the roles on GPUs, validated before anything loads.

A placement maps each role to GPU indices *relative to CUDA_VISIBLE_DEVICES* (0 is the first GPU
this process may use, whatever its physical id) or to "cpu". `validate_placement` checks it against
the machine's inventory (`components.devices`) and, given memory estimates, against free memory,
and reports every problem as one line naming the field, the GPU (visible index and physical id) and
what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from pydantic import Field, field_validator

from components.devices import GpuInfo, Inventory
from components.settings import Section

ROLES = ("rollout", "actor", "critic", "reference", "reward")
TRAINABLE_ROLES = ("actor", "critic")
GIB = 1024**3
WORKSPACE_BYTES = 1 * GIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
Assignment = list[int] | Literal["cpu"]


def _check_indices(owner: str, indices: list[int]) -> None:
    if not indices:
        raise ValueError(f"{owner}: the GPU list is empty; give indices like [0] or \"cpu\"")
    for index in indices:
        if index < 0:
            raise ValueError(f"{owner}: GPU index {index} is negative; indices count from 0 within "
                             "CUDA_VISIBLE_DEVICES")
    duplicates = sorted({index for index in indices if indices.count(index) > 1})
    if duplicates:
        raise ValueError(f"{owner}: GPU index {duplicates[0]} is listed twice in {indices}; list each GPU once")


def _check_role_name(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; valid roles: {', '.join(ROLES)}")


class PlacementConfig(Section):
    """Which GPUs (indices within CUDA_VISIBLE_DEVICES) or the CPU each role uses."""

    roles: dict[str, Assignment] = {}
    """Per role: GPU indices relative to CUDA_VISIBLE_DEVICES (e.g. actor: [0, 1]) or "cpu"."""
    default: list[int] | Literal["cpu", "auto"] = "auto"
    """For roles not listed in roles: GPU indices, "cpu", or auto ([0] when a GPU is visible, else cpu).
    Roles placed by the default may share its GPUs with each other."""
    colocate: list[list[str]] = []
    """Groups of roles allowed to share GPUs, e.g. [[rollout, actor, reference]]."""
    memory_margin_gib: float = Field(2.0, ge=0)
    """Free memory (GiB) each GPU must keep beyond the estimate of the roles placed on it."""
    allow_busy_gpus: bool = False
    """Accept GPUs on which other processes hold memory (a warning instead of an error)."""

    @field_validator("roles")
    @classmethod
    def _check_roles(cls, roles: dict[str, Assignment]) -> dict[str, Assignment]:
        for role, assignment in roles.items():
            _check_role_name(role)
            if assignment != "cpu":
                _check_indices(f"role {role}", assignment)
        return roles

    @field_validator("default")
    @classmethod
    def _check_default(cls, default: list[int] | str) -> list[int] | str:
        if isinstance(default, list):
            _check_indices("default", default)
        return default

    @field_validator("colocate")
    @classmethod
    def _check_colocate(cls, groups: list[list[str]]) -> list[list[str]]:
        for group in groups:
            for role in group:
                _check_role_name(role)
        return groups


@dataclass
class PlacementReport:
    """Where each role goes, and what is wrong (errors) or doubtful (warnings) about it."""

    assignments: dict[str, Assignment]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing would fail."""
        return not self.errors

    def raise_if_failed(self) -> None:
        """Raise ValueError listing the errors, one line each."""
        if self.errors:
            raise ValueError("\n".join(self.errors))


# --- memory estimates ------------------------------------------------------------------------------


def estimate_role_bytes(num_parameters: int, compute_bytes: int, trainable: bool, master_bytes: int = 4,
                        trained_parameters: int | None = None) -> int:
    """Bytes one copy of a role needs on its device (P = parameters, c = compute_bytes, m = master_bytes):

        inference: P*c (weights in the compute dtype) + 1 GiB (activations and workspace)
        training:  4*P*m (master weights, gradients and AdamW's two moments, all in the master dtype)
                   + P*c (the compute copy of the weights, when c < m: autocast's casts, or FSDP's
                   gathered 16-bit weights) + 1 GiB

        LoRA (`trained_parameters` = T adapter parameters, model.lora_rank > 0): P*c (the frozen base, held in
                   the compute dtype) + 16*T (the adapters' fp32 weights, gradients and two moments) + 1 GiB

    E.g. 0.5e9 parameters trained with fp32 masters and bf16 compute: 16 bytes + 2 bytes per parameter
    = 9e9 bytes + 1 GiB; in pure bf16 (m = c = 2): 8 bytes per parameter = 4e9 bytes + 1 GiB; with LoRA
    (T = 4.4e6 at rank 8, all-linear): 2 bytes per parameter + 16 * T = 1.07e9 bytes + 1 GiB.
    Activations of long sequences, the KV cache of generation and fragmentation are not included:
    the placement's memory_margin_gib covers them. Rollout engines that reserve a fraction of the
    GPU (vLLM) are budgeted by their caller.
    """
    if num_parameters < 0 or compute_bytes <= 0 or master_bytes <= 0:
        raise ValueError(f"estimate_role_bytes: num_parameters={num_parameters}, compute_bytes={compute_bytes}, "
                         f"master_bytes={master_bytes}; need num_parameters >= 0 and positive byte sizes")
    if not trainable:
        return num_parameters * compute_bytes + WORKSPACE_BYTES
    if trained_parameters is not None:  # LoRA: only the adapters have gradients and AdamW state (in fp32)
        return num_parameters * compute_bytes + 16 * trained_parameters + WORKSPACE_BYTES
    compute_copy = num_parameters * compute_bytes if compute_bytes < master_bytes else 0
    return 4 * num_parameters * master_bytes + compute_copy + WORKSPACE_BYTES


def describe_memory_basis(compute_bytes: int, master_bytes: int, lora: bool = False) -> str:
    """The estimate's rule in one line (doctor prints it beside the numbers)."""
    names = {4: "fp32", 2: "16-bit"}
    trained = (f"{4 * master_bytes} bytes per parameter ({names[master_bytes]} weights, gradients and two AdamW "
               "moments)")
    if lora:
        trained = (f"{compute_bytes} bytes per parameter (the frozen base, {names[compute_bytes]}: the compute "
                   "dtype) + 16 per LoRA adapter parameter (fp32 weights, gradients and two AdamW moments)")
    elif compute_bytes < master_bytes:
        trained += f" + {compute_bytes} ({names[compute_bytes]} compute copy)"
    return (f"estimates: trained roles {trained}, other roles {compute_bytes} bytes per parameter, each + 1 GiB "
            "workspace; activations and the KV cache are left to memory_margin_gib")


def role_requirements(num_parameters: Mapping[str, int], compute_bytes: int,
                      assignments: Mapping[str, Assignment] | None = None,
                      trainable_roles: Sequence[str] = TRAINABLE_ROLES, master_bytes: int = 4,
                      trained_parameters: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes each GPU of a role must hold, per role in `num_parameters` (see estimate_role_bytes).

    A trainable role spread over n GPUs is taken as fully sharded (FSDP): its weights, gradients
    and optimizer states divide by n, the 1 GiB workspace does not. Other roles hold a whole copy
    on every GPU they use. Roles without GPUs in `assignments` count as one device. `trained_parameters`: the
    LoRA adapter parameters of the trained roles (model.lora_rank > 0), the only ones with AdamW state.
    """
    requirements = {}
    for role, parameters in num_parameters.items():
        trainable = role in trainable_roles
        assignment = (assignments or {}).get(role, "cpu")
        shards = len(assignment) if trainable and assignment != "cpu" and assignment else 1
        trained = (trained_parameters or {}).get(role) if trainable else None
        state = estimate_role_bytes(parameters, compute_bytes, trainable, master_bytes, trained) - WORKSPACE_BYTES
        requirements[role] = -(-state // shards) + WORKSPACE_BYTES
    return requirements


def count_parameters(model_path: str, trust_remote_code: bool = False, auto_class=None) -> int:
    """Parameters of a model from its config alone: built on the meta device, no weights read.

    Tied parameters (input and output embeddings) count once. `auto_class` defaults to
    AutoModelForCausalLM; pass AutoModelForSequenceClassification for a reward model.
    """
    # on use: placement is validated before anything loads (no torch, no transformers: doctor and the CLI's check)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = (auto_class or AutoModelForCausalLM).from_config(config, trust_remote_code=trust_remote_code)
    return sum(parameter.numel() for parameter in model.parameters())


# --- validation ------------------------------------------------------------------------------------


def resolve_assignments(placement: PlacementConfig, visible_gpu_count: int, roles_in_use: Sequence[str] = ROLES,
                        modelless_roles: Sequence[str] = ()) -> dict[str, Assignment]:
    """Each role in use -> its GPU indices or "cpu", the default filled in.

    `modelless_roles` load no model (a rule reward): they go to the CPU unless placement.roles lists them.
    """
    default = placement.default
    if default == "auto":
        default = [0] if visible_gpu_count > 0 else "cpu"
    return {role: placement.roles.get(role, "cpu" if role in modelless_roles else default)
            for role in ROLES if role in roles_in_use}


def field_of(placement: PlacementConfig, role: str) -> str:
    """The config field that placed a role: placement.roles.<role>, or placement.default."""
    return f"placement.roles.{role}" if role in placement.roles else f"placement.default (used by {role})"


def describe_visible(inventory: Inventory) -> str:
    """E.g. "2 GPUs are visible (CUDA_VISIBLE_DEVICES=4,5 -> physical 4, 5)"."""
    value = inventory.cuda_visible_devices
    setting = "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value}"
    if not inventory.gpus:
        found = "" if value is not None else ", no NVIDIA GPU found"
        return f"no GPU is visible ({setting}{found})"
    physical = ", ".join(_physical_id(gpu) for gpu in inventory.gpus)
    count = len(inventory.gpus)
    return f"{count} GPU{'s are' if count > 1 else ' is'} visible ({setting} -> physical {physical})"


def _physical_id(gpu: GpuInfo) -> str:
    return str(gpu.physical_index) if gpu.physical_index >= 0 else "unknown"


def describe_gpu(gpu: GpuInfo) -> str:
    """E.g. "GPU 0 (physical 4, NVIDIA H200)"."""
    return f"GPU {gpu.index} (physical {_physical_id(gpu)}, {gpu.name})"


def _gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def _check_range(placement: PlacementConfig, inventory: Inventory, assignments: dict[str, Assignment],
                 errors: list[str]) -> None:
    """Rule 1: every index names a visible GPU."""
    count = len(inventory.gpus)
    valid = 'use "cpu"' if count == 0 else ("use index 0" if count == 1 else f"use indices 0-{count - 1}")
    for role, assignment in assignments.items():
        for index in [] if assignment == "cpu" else assignment:
            if index >= count:
                errors.append(f"{field_of(placement, role)}: GPU index {index} is out of range: "
                              f"{describe_visible(inventory)}; {valid}")


def _colocated(placement: PlacementConfig, first: str, second: str) -> bool:
    if first not in placement.roles and second not in placement.roles:
        return True  # both follow placement.default, which they share by design
    return any(first in group and second in group for group in placement.colocate)


def _gpu_roles(inventory: Inventory, assignments: dict[str, Assignment]) -> dict[int, list[str]]:
    """Visible index -> roles placed on it (indices out of range left out)."""
    placed: dict[int, list[str]] = {}
    for role, assignment in assignments.items():
        for index in [] if assignment == "cpu" else assignment:
            if index < len(inventory.gpus):
                placed.setdefault(index, []).append(role)
    return placed


def _check_sharing(placement: PlacementConfig, inventory: Inventory, placed: dict[int, list[str]],
                   errors: list[str]) -> None:
    """Rule 2: two roles share a GPU only inside one colocate group (or both by the default)."""
    for index, roles in sorted(placed.items()):
        for position, first in enumerate(roles):
            for second in roles[position + 1:]:
                if not _colocated(placement, first, second):
                    errors.append(
                        f"{field_of(placement, first)} and {field_of(placement, second)} both use "
                        f"{describe_gpu(inventory.gpus[index])}, and no placement.colocate group holds both; "
                        f"move one to another GPU or add [{first}, {second}] to placement.colocate")


def _check_memory(placement: PlacementConfig, inventory: Inventory, placed: dict[int, list[str]],
                  requirements: Mapping[str, int], errors: list[str]) -> None:
    """Rule 3: free memory covers the estimates of the roles on each GPU plus the margin."""
    margin = placement.memory_margin_gib * GIB
    for index, roles in sorted(placed.items()):
        known = [role for role in roles if role in requirements]
        if not known:
            continue
        gpu = inventory.gpus[index]
        needed = sum(requirements[role] for role in known) + margin
        if gpu.free_bytes < needed:
            parts = " + ".join(f"{role} {_gib(requirements[role])}" for role in known)
            fields = ", ".join(field_of(placement, role) for role in known)
            errors.append(f"{fields}: {describe_gpu(gpu)} has {_gib(gpu.free_bytes)} free of "
                          f"{_gib(gpu.total_bytes)} but needs {_gib(needed)} ({parts} + margin "
                          f"{placement.memory_margin_gib:g} GiB); spread the roles over more GPUs")


def _check_busy(placement: PlacementConfig, inventory: Inventory, placed: dict[int, list[str]],
                errors: list[str], warnings: list[str]) -> None:
    """Rule 4: other processes holding memory on a GPU: an error unless allow_busy_gpus."""
    for index, roles in sorted(placed.items()):
        gpu = inventory.gpus[index]
        others = [process for process in gpu.processes if process.pid != os.getpid()]
        if not others:
            continue
        listed = ", ".join(f"pid {process.pid} {process.name} ({_gib(process.used_bytes)})" for process in others)
        fields = ", ".join(field_of(placement, role) for role in roles)
        message = f"{fields}: {describe_gpu(gpu)} is busy: {listed}"
        if placement.allow_busy_gpus:
            warnings.append(f"{message}; accepted (placement.allow_busy_gpus=true)")
        else:
            errors.append(f"{message}; free it, pick another GPU, or set placement.allow_busy_gpus=true")


def _check_uniform(placement: PlacementConfig, inventory: Inventory, assignments: dict[str, Assignment],
                   warnings: list[str]) -> None:
    """Rule 5: one role's GPUs should be one model with one memory size."""
    for role, assignment in assignments.items():
        gpus = [inventory.gpus[index] for index in ([] if assignment == "cpu" else assignment)
                if index < len(inventory.gpus)]
        if len({(gpu.name, gpu.total_bytes) for gpu in gpus}) > 1:
            listed = ", ".join(f"{describe_gpu(gpu)} {_gib(gpu.total_bytes)}" for gpu in gpus)
            warnings.append(f"{field_of(placement, role)}: mixed GPUs: {listed}; sharded work runs at the pace "
                            "of the slowest and fits the smallest")


DISTRIBUTED_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "GROUP_RANK")
# A variable that makes no sense without the others.
DISTRIBUTED_NEEDS = {"RANK": ("WORLD_SIZE",), "WORLD_SIZE": ("RANK",), "LOCAL_RANK": ("LOCAL_WORLD_SIZE", "RANK"),
                     "LOCAL_WORLD_SIZE": ("LOCAL_RANK",), "GROUP_RANK": ("RANK",)}


def check_distributed_env(env: Mapping[str, str]) -> list[str]:
    """Rule 6: torchrun-style variables are complete, integers and consistent; one error line each."""
    prefix = "distributed env"
    errors, values = [], {}
    for name in DISTRIBUTED_VARIABLES:
        raw = env.get(name)
        if raw is None:
            continue
        try:
            values[name] = int(raw.strip())
        except ValueError:
            errors.append(f"{prefix}: {name}={raw!r} is not an integer")
            continue
        floor = 0 if name.endswith("RANK") else 1
        if values[name] < floor:
            errors.append(f"{prefix}: {name}={values[name]} must be >= {floor}")
    for name, needed in DISTRIBUTED_NEEDS.items():
        missing = [other for other in needed if other not in env]
        if name in env and missing:
            errors.append(f"{prefix}: {name}={env[name]} is set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not; set them together (torchrun does) or unset {name}")
    errors += _distributed_consistency(values, prefix)
    if values.get("WORLD_SIZE", 1) > 1 and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        errors.append(f"{prefix}: WORLD_SIZE={values['WORLD_SIZE']} but MASTER_ADDR and MASTER_PORT are not both "
                      "set; the ranks cannot meet")
    return errors


def _distributed_consistency(values: dict[str, int], prefix: str) -> list[str]:
    errors = []
    pairs = (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("GROUP_RANK", "NNODES"))
    for rank, size in pairs:
        if rank in values and size in values and values[rank] >= values[size] >= 1:
            errors.append(f"{prefix}: {rank}={values[rank]} must be < {size}={values[size]}")
    if {"WORLD_SIZE", "LOCAL_WORLD_SIZE"} <= values.keys() and values["LOCAL_WORLD_SIZE"] > values["WORLD_SIZE"]:
        errors.append(f"{prefix}: LOCAL_WORLD_SIZE={values['LOCAL_WORLD_SIZE']} exceeds "
                      f"WORLD_SIZE={values['WORLD_SIZE']}")
    elif {"WORLD_SIZE", "LOCAL_WORLD_SIZE", "NNODES"} <= values.keys() and \
            values["WORLD_SIZE"] != values["NNODES"] * values["LOCAL_WORLD_SIZE"]:
        errors.append(f"{prefix}: WORLD_SIZE={values['WORLD_SIZE']} != NNODES={values['NNODES']} x "
                      f"LOCAL_WORLD_SIZE={values['LOCAL_WORLD_SIZE']}")
    return errors


def validate_placement(placement: PlacementConfig, inventory: Inventory, requirements: Mapping[str, int] | None = None,
                       env: Mapping[str, str] | None = None, roles_in_use: Sequence[str] = ROLES,
                       modelless_roles: Sequence[str] = ()) -> PlacementReport:
    """Check a placement against the visible GPUs, free memory, other processes and the distributed env.

    `requirements` (bytes per GPU of each role, see `role_requirements`) enables the memory check;
    roles missing from it are not counted. `env` defaults to os.environ. Roles not in
    `roles_in_use` (the critic under GRPO) are ignored; `modelless_roles` (a rule reward) default to the CPU.
    """
    env = os.environ if env is None else env
    assignments = resolve_assignments(placement, len(inventory.gpus), roles_in_use, modelless_roles)
    report = PlacementReport(assignments=assignments)
    placed = _gpu_roles(inventory, assignments)
    _check_range(placement, inventory, assignments, report.errors)
    _check_sharing(placement, inventory, placed, report.errors)
    if requirements is not None:
        _check_memory(placement, inventory, placed, requirements, report.errors)
    _check_busy(placement, inventory, placed, report.errors, report.warnings)
    _check_uniform(placement, inventory, assignments, report.warnings)
    report.errors += check_distributed_env(env)
    return report
