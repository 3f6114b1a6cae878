"""Running a training: the flow in this process, or the embedded launcher with one worker per role.

`run_training` is what `rlhf train` / `rlhf quickstart` / `rlhf run` call. With
trainer.execution=workers it validates the placement before anything loads, starts one worker per
role pinned to its devices, supervises them, runs the flow, and stops everything on exit or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

from flows.config import Config
from flows.launcher import WorkerPool, worker_environment
from flows.worker import SHARDED_ROLES


def roles_in_use(config: Config) -> list[str]:
    roles = ["rollout", "actor", "reward"]
    if config.actor.use_kl_loss or config.algorithm.use_kl_in_reward:
        roles.append("reference")
    if config.uses_critic:
        roles.append("critic")
    return roles


def modelless_roles(config: Config) -> tuple[str, ...]:
    """Roles that load no model (a rule reward) run on the CPU unless placed explicitly."""
    return ("reward",) if config.reward.kind == "rule" else ()


def role_requirements_for_config(config: Config, visible_gpus: int) -> dict[str, int]:
    """Bytes each role needs per GPU, from parameter counts read off the model configs (no weights)."""
    from components.models import check_model_source
    from components.placement import DTYPE_BYTES, count_parameters, resolve_assignments, role_requirements

    check_model_source(config.model.path)
    policy = count_parameters(config.model.path, config.model.trust_remote_code)
    counts = {role: policy for role in roles_in_use(config) if role != "reward"}
    if "critic" in counts and config.critic.model_path:
        counts["critic"] = count_parameters(config.critic.model_path, config.model.trust_remote_code)
    if config.reward.kind == "model":
        from transformers import AutoModelForSequenceClassification

        counts["reward"] = count_parameters(config.reward.model_path, auto_class=AutoModelForSequenceClassification)
    assignments = resolve_assignments(config.placement, visible_gpus, roles_in_use(config),
                                      modelless_roles=modelless_roles(config))
    return role_requirements(counts, DTYPE_BYTES[config.model.compute_dtype], assignments,
                             master_bytes=DTYPE_BYTES[config.model.master_dtype])


def plan_placement(config: Config) -> dict[str, object]:
    """Role -> "cpu" or GPU indices, validated against this machine; raises ValueError listing problems."""
    from components.devices import inventory_from_system
    from components.placement import validate_placement

    inventory = inventory_from_system()
    requirements = role_requirements_for_config(config, len(inventory.gpus))
    report = validate_placement(config.placement, inventory, requirements, env=os.environ,
                                roles_in_use=roles_in_use(config), modelless_roles=modelless_roles(config))
    for warning in report.warnings:
        print(f"warning: {warning}")
    report.raise_if_failed()
    assignments = {role: report.assignments[role] for role in roles_in_use(config)}
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
    from components.vllm_rollout import installed_vllm

    return config.rollout.engine in ("auto", "vllm") and installed_vllm() == "vllm"


def worker_preloads(config: Config, assignments: dict[str, object]) -> dict[str, list[str]]:
    """role -> modules its worker imports before serving: vLLM for a vLLM rollout (15-20 s on a GPU host,
    then spent while the driver sets up instead of in the first validation)."""
    from flows.roles import rollout_engine_name

    rollout = assignments.get("rollout")
    if rollout is None:
        return {}
    try:
        engine = rollout_engine_name(config, "cpu" if rollout == "cpu" else "cuda")
    except ValueError:  # the rollout stage reports it
        return {}
    return {"rollout": ["vllm"]} if engine == "vllm" else {}


@contextlib.contextmanager
def worker_pool(config: Config, api_url: str) -> Iterator["WorkerPool"]:
    """Start and supervise one worker per role for this run; stop them all on exit."""
    assignments = plan_placement(config)
    heartbeat_directory = str(Path(config.run.storage_root, ".workers", config.run.name).resolve())
    env = worker_environment(api_url, config.run.storage_root, heartbeat_directory)
    os.environ["RLHF_WORKER_DIR"] = heartbeat_directory
    pool = WorkerPool(assignments, env, log_dir=Path(".rlhf/logs", config.run.name),
                      preload=worker_preloads(config, assignments))
    print("workers: " + ", ".join(f"{role} on {WorkerPool.devices_argument(devices)}"
                                  for role, devices in assignments.items()))
    pool.start()
    try:
        pool.wait_until_ready(heartbeat_directory)
        yield pool
        print_worker_summary(heartbeat_directory)
    finally:
        pool.stop()


def print_worker_summary(heartbeat_directory: str, now: float | None = None) -> None:
    """One line per worker of the run: where it ran, how often it loaded models, its peak GPU memory;
    a worker that died (and was replaced) is marked with the age of its last heartbeat."""
    import time

    from flows.worker import HEARTBEAT_INTERVAL_S, read_heartbeats

    now = time.time() if now is None else now
    for beat in sorted(read_heartbeats(heartbeat_directory), key=lambda beat: (beat["role"], beat.get("started", 0))):
        peak = beat.get("cuda_peak_allocated_gib")
        age = now - beat.get("beat", now)
        print(f"worker {beat['role']:<9} pid {beat['pid']} devices {beat['devices'] or 'cpu'} "
              f"stages run {len(beat['finished'])} model loads {beat['load_counts']}"
              + (f" peak GPU memory allocated {peak} GiB" if peak else "")
              + (f" (gone: last heartbeat {age:.0f} s ago)" if age > 5 * HEARTBEAT_INTERVAL_S else ""))


def run_training(config: Config, start_workers: bool = False) -> tuple[dict, str]:
    """Run the flow against PREFECT_API_URL or a local server; returns (summary, flow run id).

    start_workers: also start (and supervise) one worker per role on this machine, as `rlhf run`
    does; otherwise, with trainer.execution=workers, the stages go to workers started elsewhere.
    """
    from flows.launcher import prefect_server, using_prefect_api

    # One progress line per step on the terminal; task-run states stay visible in the Prefect UI.
    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    workers = config.trainer.execution == "workers"
    if start_workers:
        plan_placement(config)  # fail on a bad placement before any server or model starts
    with prefect_server() as api_url:
        storage = worker_environment(api_url, config.run.storage_root, "")["PREFECT_LOCAL_STORAGE_PATH"]
        with using_prefect_api(api_url, local_storage_path=storage if workers else None), \
                (worker_pool(config, api_url) if start_workers else contextlib.nullcontext()):
            from flows.train import train

            state = train(config, return_state=True)
            return state.result(raise_on_failure=True), str(state.state_details.flow_run_id)
