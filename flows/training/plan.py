"""Where a run's roles go and whether they fit, from the config and the machine, before anything loads.

The rules live in components/placement.py (assignments, memory per role, validation); this module
applies them to a run: which roles it uses, their parameter counts read off the model configs (no
weights), and the verdict. `rlhf run` refuses a failing plan (`plan_placement`); `rlhf doctor` shows
the same verdict (`placement_verdict`).
"""

from __future__ import annotations

import os
from typing import Mapping


from components.devices import Inventory, inventory_from_system
from components.lora import adapter_parameter_count, lora_settings
from components.models import check_model_source
from components.placement import (
    DTYPE_BYTES,
    count_parameters,
    resolve_assignments,
    role_requirements,
    validate_placement,
)
from components.vllm_build import installed_vllm
from flows.config import Config, worker_role
from flows.training.engines import rollout_engine, rollout_engine_name
from flows.training.preflight import check_model_folder
from flows.training.registry import SHARDED_ROLES


def modelless_roles(config: Config) -> tuple[str, ...]:
    """Roles that load no model (a rule reward) run on the CPU unless placed explicitly."""
    return ("reward",) if config.reward.kind == "rule" else ()


def parameter_counts(config: Config, roles: list[str]) -> tuple[dict[str, int], list[str]]:
    """Parameters per role from the models' configs (no weights read), and what could not be counted."""
    # On use: `rlhf doctor` is part of the CLI's parser, which must not pay for transformers at startup.
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    critic = "critic.model_path" if config.critic.model_path else "model.path"
    sources = {"rollout": (config.model.path, None, "model.path"), "actor": (config.model.path, None, "model.path"),
               "reference": (config.model.path, None, "model.path"),
               "critic": (config.critic.model_path or config.model.path, AutoModelForTokenClassification, critic),
               "reward": (config.reward.model_path, AutoModelForSequenceClassification, "reward.model_path")}
    counts, problems, cache = {}, [], {}
    for role in roles:
        if role in modelless_roles(config):
            continue  # a rule reward is a plain function: no model, no memory
        path, auto_class, field = sources[role]
        key = (path, auto_class)
        try:
            if key not in cache:
                check_model_folder(path, field)  # a missing local folder in its own words, not the hub's
                cache[key] = count_parameters(path, config.model.trust_remote_code, auto_class=auto_class)
            counts[role] = cache[key]
        except Exception as error:  # a missing folder, an unreachable hub, an unknown architecture
            detail = str(error).splitlines()[0] if str(error) else ""
            detail = detail if isinstance(error, ValueError) else f"{type(error).__name__}: {detail}"
            problems.append(f"could not count the parameters of {role} ({path}): {detail}; its memory check is "
                            "skipped")
    return counts, problems


def adapter_counts(config: Config, counts: dict[str, int]) -> dict[str, int] | None:
    """With LoRA (model.lora_rank > 0): the trained parameters of the actor and critic (adapters, and the critic's
    value head), the only ones with gradients and AdamW state; None without LoRA. A role whose count fails keeps
    the full fine-tuning estimate (the larger one)."""
    settings = lora_settings(config.model)
    if settings is None:
        return None
    from transformers import AutoModelForTokenClassification  # on use, as in parameter_counts

    sources = {"actor": (config.model.path, None, "CAUSAL_LM"),
               "critic": (config.critic.model_path or config.model.path, AutoModelForTokenClassification, "TOKEN_CLS")}
    trained = {}
    for role, (path, auto_class, task_type) in sources.items():
        if role in counts:
            try:
                trained[role] = adapter_parameter_count(path, settings, auto_class=auto_class, task_type=task_type,
                                                        trust_remote_code=config.model.trust_remote_code)
            except Exception:  # a target module the architecture lacks: the preflight's and the build's error
                pass
    return trained


def placement_verdict(config: Config, inventory: Inventory, env: Mapping[str, str], counts: dict[str, int]):
    """(per-GPU bytes each role needs, the components.placement report) for this run on this machine."""
    roles, modelless = config.roles, modelless_roles(config)
    assignments = resolve_assignments(config.placement, len(inventory.gpus), roles, modelless)
    requirements = role_requirements(counts, DTYPE_BYTES[config.model.compute_dtype], assignments,
                                     master_bytes=DTYPE_BYTES[config.model.master_dtype],
                                     trained_parameters=adapter_counts(config, counts))
    report = validate_placement(config.placement, inventory, requirements, env=env, roles_in_use=roles,
                                modelless_roles=modelless)
    for role, where in hosted_roles(config).items():  # a placement entry for it would be silently ignored
        if role in config.placement.roles:
            report.warnings.append(
                f"placement.roles.{role}={config.placement.roles[role]} is not used: {role} is {where}; "
                f"drop the entry (or set model.lora_rank=0 for a {role} model of its own)")
    return requirements, report


def plan_placement(config: Config) -> dict[str, object]:
    """Role -> "cpu" or GPU indices, validated against this machine; raises ValueError listing problems."""
    check_model_source(config.model.path)
    counts, problems = parameter_counts(config, config.roles)
    if problems:
        raise ValueError(problems[0].removesuffix("; its memory check is skipped"))
    _, report = placement_verdict(config, inventory_from_system(), os.environ, counts)
    for warning in report.warnings:
        print(f"warning: {warning}")
    report.raise_if_failed()
    assignments = {role: report.assignments[role] for role in config.roles}
    spanning = SHARDED_ROLES + (("rollout",) if rollout_uses_tensor_parallel(config) else ())
    for role, devices in assignments.items():
        if devices != "cpu" and len(devices) > 1 and role not in spanning:
            # Sharded reference/reward are not built, nor tensor-parallel transformers generation: a second
            # GPU would idle.
            raise ValueError(f"placement.roles.{role}={devices}: only {', '.join(spanning)} may span several GPUs "
                             "(FSDP for actor and critic, tensor parallelism for a vLLM rollout); give this role one GPU")
    return assignments


def rollout_uses_tensor_parallel(config: Config) -> bool:
    """A rollout on several GPUs is one tensor-parallel vLLM engine (needs the CUDA build of vLLM)."""
    return config.rollout.engine in ("auto", "vllm") and installed_vllm() == "vllm"


def hosted_roles(config: Config) -> dict[str, str]:
    """Roles this run uses that get no worker, GPUs or memory of their own, as the placement shows them: role -> where
    it runs. With LoRA, the reference: the actor's model with its adapter disabled (flows.config.worker_role)."""
    if not (config.uses_reference and worker_role(config, "reference") == "actor"):
        return {}
    where = "worker" if config.trainer.execution == "workers" else "process"
    return {"reference": f"the actor's model with its adapter disabled (model.lora_rank={config.model.lora_rank}), "
                         f"in the actor's {where}: no GPU or memory of its own"}


def worker_also_serves(config: Config) -> dict[str, list[str]]:
    """Worker role -> the roles whose stages it serves besides its own (`rlhf worker --also-serve`): the actor's
    serves a LoRA run's reference, which then has no worker of its own (two workers must never serve one stage)."""
    served: dict[str, list[str]] = {}
    for role in hosted_roles(config):
        served.setdefault(worker_role(config, role), []).append(role)
    return served


def worker_preloads(config: Config, assignments: dict[str, object]) -> dict[str, list[str]]:
    """role -> modules its worker imports before serving: vLLM for a vLLM rollout (15-20 s on a GPU host,
    then spent while the driver sets up instead of in the first validation)."""
    rollout = assignments.get("rollout")
    if rollout is None:
        return {}
    try:
        engine = rollout_engine_name(config, "cpu" if rollout == "cpu" else "cuda")
    except ValueError:  # the rollout stage reports it
        return {}
    preloads = rollout_engine(engine).preloads
    return {"rollout": list(preloads)} if preloads else {}
