"""The roles a run uses and how each is built: rollout engine, actor, reference, critic, reward,
tokenizer and the prompt splits.

Stage functions ask `get_role(config, name)`; the instance stays resident in whichever process runs
them (flows/runtime/residents.py), keyed by run. A trained role (actor, critic) is asked for with
`trained_role(config, name, step, stage)`, which also checks it holds the training state the stage
needs (flows/runtime/recovery.py decides where it comes from otherwise).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from components.actor import Actor
from components.checkpoint import load_trainer_state
from components.critic import Critic
from components.data import load_prompts
from components.distributed import is_distributed
from components.lora import lora_settings
from components.models import compile_layers, compiled_graphs, load_tokenizer, resolve_device, resolve_dtype
from components.reference import AdapterReference, Reference
from components.rewards import RewardModel, load_reward_function
from flows.config import Config, layout_for, worker_role
from flows.runtime import worker
from flows.runtime.console import long_work, progress
from flows.runtime.recovery import LATEST, restore_point, state_source
from flows.runtime.residents import release_role, resident
from flows.training.engines import build_rollout_engine, rollout_engine, rollout_engine_name
from storage import RunLayout


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


def _build_rollout(config: Config):
    """The engine rollout.engine names (flows/training/engines.py ROLLOUT_ENGINES), from the initial policy."""
    return build_rollout_engine(config, initial_policy_path(config), get_role(config, "tokenizer"))


def _trained_source(config: Config, checkpoint: str | None, initial: str) -> dict:
    """Where a trained role's model comes from: the checkpoint's folder, or with LoRA (model.lora_rank) the
    initial model with the checkpoint's adapter on it (a LoRA checkpoint holds the adapter only)."""
    lora = lora_settings(config.model)
    if lora is None:
        return dict(path=checkpoint or initial)
    return dict(path=initial, lora=lora, adapter=checkpoint)


def _build_actor(config: Config, restore: int | None | object = LATEST):
    restored, checkpoint = restore_point(layout_for(config), "actor", restore)
    source = _trained_source(config, checkpoint, initial_policy_path(config))
    actor = Actor.from_pretrained(source.pop("path"), config.actor,
                                  temperature=config.rollout.temperature, seed=config.trainer.seed,
                                  fused=config.model.fused_logprobs, samples_per_prompt=config.rollout.n,
                                  **source, **_trained_kwargs(config))
    _compile_if_asked(config, actor.model)
    _restore_trainer_state(actor.updater, checkpoint)
    actor.state_step = restored or 0
    """Its updates so far: the training state at the start of this step (trained_role checks it)."""
    return actor


def trained_role(config: Config, name: str, step: int, stage: str):
    """The actor or critic holding its training state at the start of `step` (its updates of steps
    0..step-1), rebuilt from the checkpoint of `step` when the resident one holds another state: a
    worker that replaced a dead one, an update that failed midway and is retried, a stage submitted
    again after it had finished, a long-lived worker still holding an earlier run of the same name.
    Raises RoleStateError (one line: what to do) when neither the resident role nor a checkpoint has it.
    """
    instance = get_role(config, name)
    if instance.state_step == step:
        return _announce_compilation(name, instance)
    held = instance.state_step
    source = state_source(layout_for(config), name, step, held, stage)
    release_role(config, name)
    instance = get_role(config, name, restore=source)
    print(f"{name}: held the training state of {'no known step' if held is None else f'step {held}'}; stage "
          f"{stage} at step {step} needs step {step}'s: rebuilt from "
          f"{'the initial weights' if source is None else f'checkpoint {source}'}")
    return _announce_compilation(name, instance)


def _announce_compilation(name: str, instance):
    """One line before the first forward of a role whose blocks model.compile compiled (they compile then: about
    30 s for a 0.5B model on an H200, with nothing else said), once per build of the role."""
    model = getattr(instance, "model", None)
    if getattr(model, "rlhf_compile_pending", False):
        model.rlhf_compile_pending = False
        progress(f"compiling the {name}'s blocks (first step) ...")
    return instance


@contextmanager
def announcing_recompiles(name: str, instance) -> Iterator[None]:
    """Around an update of a role whose blocks model.compile compiled: one line when an update after its first
    compiled them again (a new kind of batch shape: the first new sequence length, the first new row count, a
    micro-batch without padding, one of a single row; each once, and seconds on a GPU), so that a slow step says
    why."""
    model = getattr(instance, "model", None)
    if not hasattr(model, "rlhf_updates"):  # no compiled blocks (the CPU's, model.compile=false)
        yield
        return
    before, began = compiled_graphs(), time.perf_counter()
    yield
    model.rlhf_updates += 1
    added = compiled_graphs() - before
    if model.rlhf_updates > 1 and added > 0:
        progress(f"the {name}'s blocks compiled again for a new kind of batch shape ({added} graph(s); this update "
                 f"took {time.perf_counter() - began:.1f} s; each kind of shape compiles once; TORCH_LOGS=recompiles "
                 f"names the cause)")


def _restore_trainer_state(updater, checkpoint: str | None) -> None:
    if checkpoint is not None:
        load_trainer_state(updater, checkpoint)


def _compile_if_asked(config: Config, model) -> None:
    """model.compile: compile the blocks of a trained model on CUDA (not the CPU, not a sharded model)."""
    if not (config.model.compile and next(model.parameters()).is_cuda):
        return
    if is_distributed():
        print("model.compile: not applied to a sharded (FSDP) model; it runs eagerly")
        return
    print(f"model.compile: {compile_layers(model)} transformer blocks compiled")
    model.rlhf_compile_pending = True  # they compile at the first forward: trained_role says so then
    model.rlhf_updates = 0  # updates so far: announcing_recompiles says when a later one compiles again


def _build_reference(config: Config):
    if worker_role(config, "reference") == "actor":
        # LoRA: the base model is the actor's with its adapter disabled, no second copy (as verl does); under
        # workers the actor's worker runs the reference's stages (`rlhf worker --role actor --also-serve reference`).
        if worker.CURRENT is not None and worker.CURRENT.state["role"] != "actor":
            raise ValueError(f"model.lora_rank={config.model.lora_rank}: the reference is the actor's model with its "
                             f"adapter disabled and runs in the actor's worker, not in this {worker.CURRENT.state['role']}"
                             " worker; stop it and start the actor's with `rlhf worker --role actor --also-serve "
                             "reference`")
        return AdapterReference(lambda: get_role(config, "actor"), micro_batch_size=config.actor.micro_batch_size)
    return Reference.from_pretrained(initial_policy_path(config), temperature=config.rollout.temperature,
                                     micro_batch_size=config.actor.micro_batch_size, fused=config.model.fused_logprobs,
                                     **_model_kwargs(config))


def _build_critic(config: Config, restore: int | None | object = LATEST):
    restored, checkpoint = restore_point(layout_for(config), "critic", restore)
    # The value head is initialised at random: seed it, so that it does not depend on which stages
    # ran before in this process (a resumed run skips some), and leave the global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.trainer.seed)
        source = _trained_source(config, checkpoint, config.critic.model_path or initial_policy_path(config))
        critic = Critic.from_pretrained(source.pop("path"), config.critic, seed=config.trainer.seed,
                                        samples_per_prompt=config.rollout.n, **source, **_trained_kwargs(config))
    _compile_if_asked(config, critic.model)
    _restore_trainer_state(critic.updater, checkpoint)
    critic.state_step = restored or 0
    return critic


def _build_reward(config: Config):
    if config.reward.kind == "model":  # in the compute dtype, as every model that does not train
        return RewardModel.from_pretrained(config.reward.model_path, device=resolve_device(config.trainer.device),
                                           dtype=resolve_dtype(config.model.compute_dtype))
    return load_reward_function(config.reward.function)


def _build_tokenizer(config: Config):
    return load_tokenizer(config.model.path, config.model.trust_remote_code)


def _load_prompt_split(config: Config, files: list[str], field: str):
    records, _filtered = load_prompts(files, get_role(config, "tokenizer"), max_prompt_length=config.data.max_prompt_length,
                                      overlong=config.data.overlong_prompts, field=field,
                                      target=config.warm_start.target)
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


def _loading_note(config: Config, name: str) -> tuple[str, str] | None:
    """What the progress lines say while a model role loads: (what, a note on how long it takes), or None: no
    line, a quick build."""
    if name == "rollout":
        return rollout_engine(rollout_engine_name(config)).loading
    if name == "reference" and worker_role(config, name) == "actor":
        return None  # the actor's model with its adapter disabled: nothing loads
    if name in ("actor", "reference", "critic") or (name == "reward" and config.reward.kind == "model"):
        return f"loading the {name} model", ""
    return None


def get_role(config: Config, name: str, **build_options) -> Any:
    """The resident instance of role `name` for this run, built on first use (with `build_options`,
    e.g. a trained role's `restore`); a model's load is announced as progress lines, with a line every 20 s
    while it lasts (a vLLM engine start takes minutes on a GPU)."""

    def build():
        note = _loading_note(config, name)
        if note is None:
            return BUILDERS[name](config, **build_options)
        what, how_long = note
        with long_work(f"{what}{how_long} ...", f"{what}: {{seconds:.0f}} s so far", f"{name} ready in {{seconds:.1f}} s"):
            return BUILDERS[name](config, **build_options)

    return resident(config, name, build)
