"""What a config's run will do here, for `rlhf doctor CONFIG` (flows/tools/doctor.py): which engine generates,
how the rollout gets each step's weights, how checkpoints are written. No model loads.
"""

from __future__ import annotations

import os
import time
import uuid

import fsspec

from components.placement import DTYPE_BYTES
from components.vllm_build import vllm_version
from flows.runtime.weights import weight_sync_mode
from flows.training.engines import engine_tensor_parallel, rollout_engine_name, rollout_sleeps
from flows.training.plan import adapter_counts, parameter_counts

WRITE_PROBE_BYTES = 64 * 2**20
"""What `rlhf doctor` writes under the storage root to time a checkpoint's writing."""
STALL_SHARE = 0.05
"""The share of a step a checkpoint's writing may cost on average (the presets' cadence keeps under it)."""


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


def checkpoint_report(config, counts: dict[str, int] | None = None, speed: float | None = None) -> dict:
    """How often the roles' training state is checkpointed, whether the run waits for the writing, and what one
    costs here: its size from the trained roles' parameter counts (`counts`, counted from the models' configs when
    not given) and the time to write it at the storage root's measured speed (`speed`, bytes/s: measured now when
    not given)."""
    trainer = config.trainer
    if not trainer.checkpoint_every:
        return {"detail": "never (trainer.checkpoint_every=0): a failed run starts over"}
    how = ("written in the background (trainer.checkpoint_async): the next step starts once the weights and "
           "AdamW state are copied to host memory, its update waits for the commit; the last at once"
           if trainer.checkpoint_async else "written before the next step starts (trainer.checkpoint_async=false)")
    report = {"detail": f"every {trainer.checkpoint_every} steps and the last, the newest "
                        f"{trainer.keep_checkpoints} kept, {how}"}
    trained = ["actor"] + (["critic"] if config.uses_critic else [])
    counts = parameter_counts(config, trained)[0] if counts is None else counts
    if not all(role in counts for role in trained):
        return _with_cost(report, "size unknown (the models' parameters could not be counted: see Placement)")
    per_parameter = 3 * DTYPE_BYTES[config.model.master_dtype]  # the weights and AdamW's two moments
    adapters = adapter_counts(config, counts)  # LoRA: a checkpoint holds the adapters (fp32) and their moments
    lora = adapters is not None and all(role in adapters for role in trained)
    if lora:
        counts, per_parameter = adapters, 12
    size = sum(counts[role] for role in trained) * per_parameter
    speed, where = storage_write_speed(config.run.storage_root) if speed is None else (speed, "given")
    report |= {"bytes": size, "write_bytes_per_s": speed}
    what = (f"each {size / 1e9:.2f} GB ({' + '.join(trained)}: {per_parameter} bytes a parameter, "
            + ("the LoRA adapters' float32 weights and AdamW's two moments; the base is the initial model)"
               if lora else
               f"{config.model.master_dtype} weights and AdamW's two moments)"))
    if speed is None:
        return _with_cost(report, f"{what}; the storage root's write speed was not measured ({where})")
    seconds = size / speed
    per_step = seconds / trainer.checkpoint_every
    return _with_cost(report | {"write_s": seconds}, (
        f"{what}, about {seconds:.1f} s to write at {speed / 1e6:.0f} MB/s ({where}): {per_step:.2f} s a step on "
        f"average, under {STALL_SHARE:.0%} of steps longer than {per_step / STALL_SHARE:.1f} s "
        "(trainer.checkpoint_every sets the cadence)"))


def _with_cost(report: dict, cost: str) -> dict:
    return report | {"cost": cost, "detail": f"{report['detail']}; {cost}"}


def storage_write_speed(root: str) -> tuple[float | None, str]:
    """(bytes/s of one WRITE_PROBE_BYTES write under `root`, flushed to the disk where it is local; how it was
    measured), or (None, why not)."""
    try:
        fs, path = fsspec.core.url_to_fs(root)
        fs.makedirs(path, exist_ok=True)
        probe = f"{path.rstrip('/')}/.rlhf-doctor-speed-{uuid.uuid4().hex}"
        block = b"\0" * (4 * 2**20)
        started = time.perf_counter()
        try:
            with fs.open(probe, "wb") as handle:
                for _ in range(WRITE_PROBE_BYTES // len(block)):
                    handle.write(block)
                handle.flush()
                if hasattr(handle, "fileno"):  # a local file: to the disk, not only the page cache
                    os.fsync(handle.fileno())
            seconds = time.perf_counter() - started
        finally:
            fs.rm(probe)
    except Exception as error:  # noqa: BLE001 - permissions, backends: the storage check says what is wrong
        return None, f"{type(error).__name__}: {error}"
    return WRITE_PROBE_BYTES / max(seconds, 1e-6), f"a {WRITE_PROBE_BYTES // 2**20} MiB write to {root} just now"
