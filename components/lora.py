"""LoRA adapters on the trained roles (peft), as verl's `model.lora_rank`: W' = W + (alpha / r) * B @ A.

With `model.lora_rank > 0` the actor (and the critic) wraps its model with peft's LoRA: the base weights are
frozen (held in the compute dtype: nothing updates it), only the adapters (`lora_A`, `lora_B`, and a critic's value
head) take gradients and AdamW state, in
float32 (the fp32-master convention, components/precision.py). What the rest of the run sees:

- the rollout gets merged weights under the base model's names (`MergedWeights`: W + delta, computed on the
  fly into compute-dtype tensors; the training model is never merged in place), through the usual hand-over;
- the reference policy is the same model with its adapter disabled (components.reference.AdapterReference), in
  the actor's process: under trainer.execution=workers the actor's worker runs the reference's stages;
- checkpoints hold the adapter (a peft folder: adapter_config.json, adapter_model.safetensors) and its
  optimizer state; the base comes from the run's initial policy again on resume.

Not yet: a sharded (FSDP) actor or critic with LoRA; the config refuses it (`sharded_lora_problem`).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
VALUE_HEADS = ["score", "classifier"]
"""The heads of transformers' token-classification models (the critic's value head)."""


def lora_settings(model_config) -> dict | None:
    """The LoRA settings of a `model` config section (None: LoRA is off)."""
    if not getattr(model_config, "lora_rank", 0):
        return None
    return dict(rank=model_config.lora_rank, alpha=model_config.lora_alpha, dropout=model_config.lora_dropout,
                target_modules=model_config.target_modules)


def sharded_lora_problem(model_config, placement, execution: str, uses_critic: bool) -> str | None:
    """One line when LoRA meets a trained role placed on several GPUs (a sharded FSDP actor or critic), which is
    not supported yet; None otherwise. The placement applies only under trainer.execution=workers."""
    if not getattr(model_config, "lora_rank", 0) or execution != "workers":
        return None
    for role in ("actor", "critic") if uses_critic else ("actor",):
        assignment = placement.roles.get(role, placement.default)
        if isinstance(assignment, list) and len(assignment) > 1:
            where = (f"placement.roles.{role}={assignment}" if role in placement.roles
                     else f"placement.default={assignment} (used by the {role})")
            return (f"model.lora_rank={model_config.lora_rank} with {where}: LoRA with the {role} sharded "
                    f"over several GPUs (FSDP) is not supported yet; give the {role} one GPU (e.g. "
                    f"placement.roles.{role}=[{assignment[0]}]) or set model.lora_rank=0 (full fine-tuning)")
    return None


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: str | list[str] = "all-linear", task_type: str = "CAUSAL_LM",
               exclude_modules: list[str] | None = None):
    """`model` wrapped by peft's LoRA (a PeftModel): frozen base, trainable float32 adapters. With
    task_type TOKEN_CLS (the critic) the value head trains in full (peft's modules_to_save) and gets no adapter."""
    # on use: peft imports transformers and accelerate (seconds); the config and the CLI import this module
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type=task_type, bias="none",
                        exclude_modules=exclude_modules or (VALUE_HEADS if task_type == "TOKEN_CLS" else None))
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:  # target modules that match nothing in this architecture
        raise ValueError(f"model.target_modules={target_modules!r}: {str(error).splitlines()[0]}; give "
                         "'all-linear' or names of the model's linear layers (e.g. [q_proj, v_proj])") from None
    for parameter in peft_model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()  # adapters are masters: float32 whatever the base holds
    return peft_model


def adapter_parameter_count(model_path: str, settings: dict, *, auto_class=None, trust_remote_code: bool = False,
                            task_type: str = "CAUSAL_LM") -> int:
    """The trained parameters of `model_path` with LoRA `settings` (adapters, and a critic's value head), from
    its config alone: built on the meta device, no weights read (the placement's memory estimate)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                        **({"num_labels": 1} if task_type == "TOKEN_CLS" else {}))
    with torch.device("meta"):
        model = (auto_class or AutoModelForCausalLM).from_config(config, trust_remote_code=trust_remote_code)
        model = apply_lora(model, **settings, task_type=task_type)
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapter's trained tensors (peft's names, as adapter_model.safetensors holds them)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_adapter(model, folder: str) -> None:
    """Load the adapter tensors of a peft folder (a LoRA checkpoint) into `model`, exactly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.exists():
        raise ValueError(f"{folder}: no {ADAPTER_WEIGHTS}; a checkpoint of a run without LoRA (model.lora_rank=0) "
                         "cannot resume with LoRA on")
    result = set_peft_model_state_dict(model, load_file(str(path), device=str(next(model.parameters()).device)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"{folder}: its adapter does not fit this model (unexpected tensors, e.g. {unexpected[0]}); "
                         "resume with the run's model.lora_rank and model.target_modules")


def _lora_layers(model) -> dict[str, torch.nn.Module]:
    """Base-model module name -> peft LoRA layer (its `base_layer` holds the frozen weight)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def base_name(name: str) -> str:
    """A peft parameter name as the base model names it (no `base_model.model.`, no `.base_layer`)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def merged_state_dict(model, dtype: torch.dtype | None = None, keep_vars: bool = False) -> "OrderedDict[str, torch.Tensor]":
    """The base model's state dict with every LoRA delta merged in: W + scale * B @ A under W's name, as peft's
    merge_and_unload gives it, without changing `model`. Merged weights are new tensors (cast to `dtype` when
    given); every other tensor is the model's own (detached, unless `keep_vars`: the parameters themselves)."""
    layers = _lora_layers(model)
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, layer in layers.items():
            base = layer.get_base_layer().weight
            weight = base.float()  # summed in float32, rounded once (the base is in the compute dtype)
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    weight = weight + layer.get_delta_weight(adapter).float()
            merged[f"{name}.weight"] = weight.to(base.dtype if dtype is None else dtype)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, tensor in model.get_base_model().state_dict(keep_vars=True).items():
        if ".lora_" in name or ".original_module." in name:
            continue
        name = base_name(name)
        state[name] = merged.get(name, tensor if keep_vars else tensor.detach())
    return state


class MergedWeights:
    """What the weight hand-over publishes for a LoRA actor: the merged model under the base model's names.

    It stands in for the model where the transport reads one (`state_dict`, `config`, `generation_config`,
    `save_pretrained`, `parameters`). The merged tensors of the last `state_dict()` call are kept (in the
    compute dtype) until the next one: a hand-over that streams later (the sender's plan holds weak references)
    still finds them; they are a compute-dtype copy of the adapted layers only."""

    def __init__(self, model, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype
        self._held: OrderedDict | None = None

    @property
    def base(self):
        return self.model.get_base_model()

    @property
    def config(self):
        return self.base.config

    @property
    def generation_config(self):
        return getattr(self.base, "generation_config", None)

    def parameters(self):
        return self.model.parameters()

    def state_dict(self, keep_vars: bool = False) -> OrderedDict:
        self._held = merged_state_dict(self.model, self.dtype, keep_vars)
        return self._held

    def save_pretrained(self, folder, state_dict=None, **kwargs) -> None:
        """The merged model as a transformers folder (a plain architecture: no peft modules in it)."""
        state = self.state_dict() if state_dict is None else state_dict
        # save_pretrained of the injected model would look at its peft modules; a plain copy of the config
        # with the merged tensors is what transformers and vLLM load.
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(folder)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(folder)
        unique: dict[str, torch.Tensor] = {}
        seen: dict[tuple, str] = {}
        for name, tensor in state.items():  # tied tensors once (the LM head of a tied embedding)
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if key in seen and tensor.numel():
                continue
            seen[key] = name
            unique[name] = tensor.detach().contiguous().cpu()
        save_file(unique, str(folder / "model.safetensors"), metadata={"format": "pt"})

