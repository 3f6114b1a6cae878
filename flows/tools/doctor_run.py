"""What a config's run will do here, for `rlhf doctor CONFIG` (flows/tools/doctor.py): which engine generates,
how the rollout gets each step's weights, how checkpoints are written. No model loads.
"""

from __future__ import annotations

from components.vllm_rollout import vllm_version
from flows.runtime.transport import weight_sync_mode
from flows.training.engines import engine_tensor_parallel, rollout_engine_name, rollout_sleeps


def rollout_engine_report(config, placement: dict, has_gpus: bool) -> dict:
    """Which generation engine the rollout role will use where it runs, and how (no model loads)."""
    if config.trainer.execution == "workers":
        devices = (placement.get("assignments") or {}).get("rollout", "cpu")
    else:
        devices = "cpu" if config.trainer.device == "cpu" or not has_gpus else [0]
    device = "cpu" if devices == "cpu" else "cuda"
    try:
        engine = rollout_engine_name(config, device)
    except ValueError as error:
        return {"engine": "vllm", "status": "fail", "detail": str(error)}
    if engine == "hf":
        why = "rollout.engine=hf" if config.rollout.engine == "hf" else f"no vLLM build for {device} installed"
        return {"engine": "hf", "detail": f"transformers generate on {device} ({why})"}
    if device == "cpu":
        return {"engine": "vllm", "detail": f"{vllm_version()} on the CPU"}
    gpus = len(devices) if config.trainer.execution == "workers" else 1
    engines = f"{config.rollout.engines} engines, each " if config.rollout.engines > 1 else ""
    residency = "sleeps between generations" if rollout_sleeps(config, True) else "stays resident"
    return {"engine": "vllm", "detail": f"{vllm_version()} on GPU {devices}, {engines}tensor parallel "
                                        f"{engine_tensor_parallel(config, gpus)}, {residency}"}


def _between_workers(config, assignments: dict) -> str:
    """How a streamed version goes from the actor's worker to the rollout's, by their placement."""
    bucket = f"in buckets of {config.rollout.update_weights_bucket_megabytes} MiB"
    actor, rollout = assignments.get("actor", "cpu"), assignments.get("rollout", "cpu")
    if actor == "cpu" or rollout == "cpu":
        return f"over a gloo group (CPU) from the actor's worker to the rollout's, {bucket}"
    if actor[0] in rollout:
        return (f"over CUDA IPC from the actor's worker to the rollout's (both see GPU {actor[0]}: no copy through "
                f"the host), {bucket}")
    return f"over NCCL from the actor's worker (GPU {actor[0]}) to the rollout's (GPUs {rollout}), {bucket}"


def weight_sync_report(config, engine: str, engine_detail: str, assignments: dict | None = None) -> dict:
    """How the rollout engine gets each step's weights (trainer.weight_sync resolved) and what is stored."""
    trainer = config.trainer
    if weight_sync_mode(config) == "storage":
        return {"mode": "storage", "detail": "through storage (trainer.weight_sync=storage): the actor writes "
                                             "weights/actor/<step> every step and the rollout reads it back"}
    if trainer.execution == "workers":
        how = (f"{_between_workers(config, assignments or {})}; workers on other hosts: NCCL to the actor host's "
               "address (RLHF_WEIGHTS_ADDRESS), or trainer.weight_sync=storage where hosts cannot reach each other")
    elif engine == "hf":
        how = "tensor by tensor into the transformers engine"
    elif "GPU" in engine_detail:
        how = (f"over CUDA IPC to vLLM's workers, in buckets of {config.rollout.update_weights_bucket_megabytes} "
               "MiB")
    else:
        how = f"as bytes to vLLM's workers, in buckets of {config.rollout.update_weights_bucket_megabytes} MiB"
    stored = ("every step" if trainer.keep_weights is None else
              f"every {trainer.checkpoint_every} steps (checkpoints) and the last" if trainer.checkpoint_every
              else "the last step")
    return {"mode": "memory", "detail": f"in memory from the actor's live model, {how}; a copy is stored in the "
                                        f"background for {stored}"}


def checkpoint_report(config) -> dict:
    """How often the roles' training state is checkpointed, and whether the run waits for the writing."""
    trainer = config.trainer
    if not trainer.checkpoint_every:
        return {"detail": "never (trainer.checkpoint_every=0): a failed run starts over"}
    how = ("written in the background (trainer.checkpoint_async): the next step starts once the weights and "
           "AdamW state are copied to host memory, its update waits for the commit; the last at once"
           if trainer.checkpoint_async else "written before the next step starts (trainer.checkpoint_async=false)")
    return {"detail": f"every {trainer.checkpoint_every} steps and the last, the newest "
                      f"{trainer.keep_checkpoints} kept, {how}"}
