"""The critic: a value head on an HF backbone (`AutoModelForTokenClassification`, one label).

Loading a causal-LM checkpoint this way keeps its backbone and adds a fresh value head, so the
critic can start from the policy's weights, as in verl.
"""

from __future__ import annotations

import torch
from pydantic import Field

from components.algorithms import value_loss
from components.batch import PaddingPlan, SequenceBatch, aligned, micro_batches, pad_responses
from components.distributed import is_distributed
from components.lora import apply_lora, load_adapter
from components.models import load_pretrained
from components.models import model_source
from components.precision import Precision, prepare_trained_model
from components.settings import Section
from components.training import OptimConfig, Updater, device_rows, micro_rows, to_device


class CriticConfig(Section):
    model_path: str | None = None
    """Backbone of the value model (None: the initial policy)."""
    optim: OptimConfig = OptimConfig(lr=1e-5)
    """Optimizer of the critic."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each step's batch."""
    ppo_mini_batch_size: int = Field(32, gt=0)
    """Prompts per optimizer step, as verl counts them (this many times rollout.n samples)."""
    micro_batch_size: int = Field(32, gt=0)
    """Samples per forward/backward."""
    cliprange_value: float = Field(0.5, gt=0)
    """Value clipping range."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation of the value loss."""


def response_values(model, batch: SequenceBatch) -> torch.Tensor:
    """Values `[B, T]`: the value at position P-1+t estimates the state before response token t."""
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False)
    values = output.logits[:, batch.prompt_length - 1 : -1, 0].float()
    return values * batch.response_mask


class Critic:
    def __init__(self, model, config=None, *, seed: int = 0, samples_per_prompt: int = 1):
        self.model = model
        self.config = config or CriticConfig()
        self.updater = Updater(model, self.config, seed, samples_per_prompt)

    @classmethod
    def from_pretrained(cls, path: str, config=None, *, dtype="float32", master_dtype="float32", device="auto",
                        attn_implementation="auto", trust_remote_code=False, seed=0, gradient_checkpointing=False,
                        samples_per_prompt=1, lora: dict | None = None, adapter: str | None = None):
        """dtype: the compute dtype; master_dtype: the parameters' and optimizer state's (as for the actor).
        lora, adapter: as the actor's (components.lora); the value head trains in full beside the adapters."""
        # on use: transformers takes about a second to import; the config, the CLI and doctor import this module
        from transformers import AutoConfig, AutoModelForTokenClassification

        # No dropout before the value head: update() runs in train mode and must see the same values
        # that compute_values() produced in eval mode (old_values), or the clipped loss is biased.
        model_config = AutoConfig.from_pretrained(model_source(path), trust_remote_code=trust_remote_code,
                                                  num_labels=1)
        model_config.classifier_dropout = 0.0  # transformers 5 drops it when given as a kwarg
        precision = Precision.of(dtype, master_dtype)
        model = load_pretrained(AutoModelForTokenClassification, path,  # LoRA: the base in the compute dtype
                                dtype=precision.master if lora is None else precision.compute,
                                compute_dtype=precision.compute, device=device,
                                attn_implementation=attn_implementation,
                                trust_remote_code=trust_remote_code, config=model_config)
        if lora is not None:
            if is_distributed():
                raise ValueError("model.lora_rank > 0 is not supported yet with a sharded (FSDP) critic; place the "
                                 "critic on one GPU or set model.lora_rank=0")
            model = apply_lora(model, **lora, task_type="TOKEN_CLS")
            if adapter is not None:
                load_adapter(model, adapter)
        prepare_trained_model(model, precision, gradient_checkpointing)
        return cls(model, config, seed=seed, samples_per_prompt=samples_per_prompt)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        self.model.eval()
        return torch.cat([pad_responses(response_values(self.model, micro.to(self.device)), batch.response_length).cpu()
                          for micro in micro_batches(batch, self.config.micro_batch_size, aligned(self.device))])

    def update(self, batch: SequenceBatch, *, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """Clipped value regression on the returns (inputs `[B, T]`); returns `critic/*` metrics."""
        config = self.config
        device = self.device
        response_mask = batch.response_mask  # on the host: the loop's row weights are read without a sync
        plan = PaddingPlan(batch, aligned(device))  # each micro-batch cut to its longest row (bounds read on the host)
        batch = batch.to(device)
        old_values, returns = to_device(device, old_values, returns)

        def micro_loss(indices: torch.Tensor):
            rows = device_rows(indices, device)
            micro, width = plan.cut(batch, indices, rows)
            return value_loss(values=response_values(self.model, micro),
                              old_values=micro_rows(old_values, rows, width),
                              returns=micro_rows(returns, rows, width), response_mask=micro.response_mask,
                              cliprange_value=config.cliprange_value, loss_agg_mode=config.loss_agg_mode)

        return self.updater.update(response_mask, micro_loss, prefix="critic", row_lengths=plan.lengths)
