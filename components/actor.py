"""The actor: the policy being trained (an HF causal LM), its log-probs and its PPO update.

Usable on its own:

    actor = Actor.from_pretrained("path/or/hub-name")
    generations = actor.generate(["12+34="], n=4, max_new_tokens=8)
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from pydantic import Field

from components.algorithms import aggregate_loss, get_policy_loss, kl_loss, logprob_gap
from components.algorithms.fused import logprobs_and_entropy
from components.distributed import is_distributed
from components.batch import PaddingPlan, SequenceBatch, aligned, micro_batches, model_logits, pad_responses
from components.lora import MergedWeights, apply_lora, is_lora, load_adapter
from components.models import load_causal_lm, load_tokenizer
from components.precision import Precision, prepare_trained_model
from components.rollout import HFRolloutEngine, SamplingParams
from components.settings import Section
from components.training import OptimConfig, Updater, device_rows, micro_rows, to_device


class ActorConfig(Section):
    reuse_update_logprobs: bool = True
    """When the update is on-policy (ppo_epochs=1 and one mini-batch holding the whole step, no KL in the
    reward), skip the separate old-log-prob pass: the update's own forward gives the same log-probs before
    its only optimizer step (rollout/logprob_diff_* then come from that forward)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer of the policy."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each step's batch."""
    ppo_mini_batch_size: int = Field(32, gt=0)
    """Prompts per optimizer step, as verl counts them: each mini-batch holds their samples, this many times
    rollout.n (the actor's `samples_per_prompt`)."""
    micro_batch_size: int = Field(32, gt=0)
    """Samples per forward/backward (gradient accumulation over a mini-batch), as verl's
    ppo_micro_batch_size_per_gpu."""
    policy_loss: str = "ppo"
    """Registered policy loss (components.algorithms.losses)."""
    clip_ratio_low: float = Field(0.2, ge=0)
    """PPO ratio clip below 1."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO ratio clip above 1."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (Ye et al. 2020)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum or seq-mean-token-mean."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add KL to the reference as a loss term (GRPO style) instead of a reward penalty."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss term: k1, abs, k2/mse, k3/low_var_kl."""


def _accumulate_gap(gap: dict, logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Add one micro-batch's |actor - rollout engine| log-prob gap over response tokens to `gap`.

    Rows without the engine's log-probs (NaN: rollout.logprobs_fraction) are left out of the gap. The sums
    stay on the device (read once after the update)."""
    nonfinite = (~torch.isfinite(logprobs) & mask.bool()).any(dim=-1).sum()
    difference, measured = logprob_gap(logprobs, rollout_logprobs, mask)
    largest = difference.max() if difference.numel() else difference.new_zeros(())
    if not gap:
        gap.update(sum=difference.new_zeros(()), tokens=difference.new_zeros(()), max=difference.new_zeros(()),
                   nonfinite=nonfinite.new_zeros(()))
    gap["nonfinite"] += nonfinite
    gap["sum"] += difference.sum()
    gap["tokens"] += measured.sum()
    gap["max"] = torch.maximum(gap["max"], largest)


@torch.no_grad()
def sequence_logprobs(
    model, batch: SequenceBatch, *, temperature: float, micro_batch_size: int, with_entropy: bool = False,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[B, T]` of the batch's response tokens (and entropies `[B, T]`), masked to 0.

    fused: one Triton kernel over the model's logits on CUDA (components.algorithms.fused).
    """
    model.eval()
    device = next(model.parameters()).device
    logprob_parts, entropy_parts = [], []
    for micro in micro_batches(batch, micro_batch_size, aligned(device)):
        micro = micro.to(device)
        logprobs, entropy = logprobs_and_entropy(model_logits(model, micro), micro.response_ids, temperature,
                                                 fused=fused, with_entropy=with_entropy)
        logprob_parts.append(pad_responses(logprobs * micro.response_mask, batch.response_length).cpu())
        if with_entropy:
            entropy_parts.append(pad_responses(entropy * micro.response_mask, batch.response_length).cpu())
    entropy = torch.cat(entropy_parts) if with_entropy else None
    return torch.cat(logprob_parts), entropy


class Actor:
    """Policy model + optimizer. `temperature` must match the rollout's sampling temperature."""

    def __init__(self, model, tokenizer, config=None, *, temperature: float = 1.0, seed: int = 0, fused: bool = True,
                 samples_per_prompt: int = 1, compute_dtype: torch.dtype | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or ActorConfig()
        self.temperature = temperature
        self.fused = fused
        """Log-probs and entropy by the fused kernel on CUDA (model.fused_logprobs)."""
        self.updater = Updater(model, self.config, seed, samples_per_prompt)
        """Its mini-batches hold config.ppo_mini_batch_size x samples_per_prompt (rollout.n) samples."""
        self.lock = threading.RLock()
        """Held by every pass over the model: a LoRA run's reference disables the adapter of this same model
        (components.lora.AdapterReference), and stages run concurrently on threads."""
        self.compute_dtype = compute_dtype
        """The dtype the merged LoRA weights are handed over in (None: the masters')."""
        self._merged = None

    @property
    def policy_model(self):
        """What the rollout gets the weights of: the model itself, or with LoRA its merged view (base names,
        W + delta; components.lora.MergedWeights)."""
        if not is_lora(self.model):
            return self.model
        if self._merged is None:
            self._merged = MergedWeights(self.model, self.compute_dtype)
        return self._merged

    @classmethod
    def from_pretrained(cls, path: str, config=None, *, dtype="float32", master_dtype="float32", device="auto",
                        attn_implementation="auto", trust_remote_code=False, temperature=1.0, seed=0, fused=True,
                        gradient_checkpointing=False, samples_per_prompt=1, lora: dict | None = None,
                        adapter: str | None = None):
        """dtype: the compute dtype; master_dtype: the parameters' and optimizer state's (components.precision:
        float32 masters computing in bf16 under autocast, or FSDP2's mixed precision when sharded).
        lora: components.lora.apply_lora's settings (rank, alpha, dropout, target_modules), None: full fine-tuning;
        adapter: a LoRA checkpoint folder whose adapter is loaded onto the base model at `path`."""
        precision = Precision.of(dtype, master_dtype)
        # LoRA: the frozen base stays in the compute dtype (nothing updates it); the adapters train in float32
        base_dtype = precision.master if lora is None else precision.compute
        model = load_causal_lm(path, dtype=base_dtype, compute_dtype=precision.compute, device=device,
                               attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        if lora is not None:
            if is_distributed():
                raise ValueError("model.lora_rank > 0 is not supported yet with a sharded (FSDP) actor; place the "
                                 "actor on one GPU or set model.lora_rank=0")
            model = apply_lora(model, **lora)
            if adapter is not None:
                load_adapter(model, adapter)
        prepare_trained_model(model, precision, gradient_checkpointing)
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, config, temperature=temperature, seed=seed, fused=fused,
                   samples_per_prompt=samples_per_prompt, compute_dtype=precision.compute)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def compute_logprobs(self, batch: SequenceBatch, with_entropy: bool = False):
        with self.lock:
            return sequence_logprobs(self.model, batch, temperature=self.temperature,
                                     micro_batch_size=self.config.micro_batch_size, with_entropy=with_entropy,
                                     fused=self.fused)

    def update(self, batch: SequenceBatch, *, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None,
               rollout_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One PPO update over the batch (all inputs `[B, T]`); returns `actor/*` metrics.

        old_logprobs=None: the update is on-policy (one epoch, one mini-batch, so one optimizer step after
        every forward), and each forward's own log-probs, detached, are the old ones. Then
        `rollout_logprobs` (the engine's) give rollout/logprob_diff_mean and _max from the same forward.
        """
        config = self.config
        if config.use_kl_loss and ref_logprobs is None:
            raise ValueError("actor.use_kl_loss=true needs reference log-probs")
        if old_logprobs is None and (config.ppo_epochs != 1 or self.updater.mini_batch_samples < batch.size):
            raise ValueError("old_logprobs=None needs an on-policy update: actor.ppo_epochs=1 and a mini-batch of "
                             f"at least {batch.size} samples (the batch)")
        policy_loss = get_policy_loss(config.policy_loss)
        device = self.device
        gap: dict[str, torch.Tensor] = {}
        response_mask = batch.response_mask  # on the host: the loop's row weights are read without a sync
        plan = PaddingPlan(batch, aligned(device))  # each micro-batch cut to its longest row (bounds read on the host)
        batch = batch.to(device)
        old_logprobs, advantages, ref_logprobs, rollout_logprobs = to_device(
            device, old_logprobs, advantages, ref_logprobs, rollout_logprobs)

        def micro_loss(indices: torch.Tensor):
            rows = device_rows(indices, device)
            micro, width = plan.cut(batch, indices, rows)
            # The entropy is a metric without an autograd graph unless entropy_coeff puts it in the loss.
            logprobs, token_entropy = logprobs_and_entropy(
                model_logits(self.model, micro), micro.response_ids, self.temperature,
                entropy_grad=bool(config.entropy_coeff), fused=self.fused)
            if rollout_logprobs is not None:
                _accumulate_gap(gap, logprobs.detach(), micro_rows(rollout_logprobs, rows, width), micro.response_mask)
            loss, metrics = policy_loss(
                logprobs=logprobs,
                old_logprobs=logprobs.detach() if old_logprobs is None else micro_rows(old_logprobs, rows, width),
                advantages=micro_rows(advantages, rows, width), response_mask=micro.response_mask,
                clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode,
            )
            entropy = aggregate_loss(token_entropy, micro.response_mask, config.loss_agg_mode)
            metrics["actor/entropy"] = entropy.detach()
            if config.entropy_coeff:
                loss = loss - config.entropy_coeff * entropy
            if config.use_kl_loss:
                kl_term, kl_metrics = kl_loss(
                    logprobs=logprobs, ref_logprobs=micro_rows(ref_logprobs, rows, width),
                    response_mask=micro.response_mask, estimator=config.kl_loss_type,
                    loss_agg_mode=config.loss_agg_mode,
                )
                loss = loss + config.kl_loss_coef * kl_term
                metrics.update(kl_metrics)
            return loss, metrics

        with self.lock:
            metrics = self.updater.update(response_mask, micro_loss, prefix="actor", row_lengths=plan.lengths)
        gap = {name: float(value) for name, value in gap.items()}
        if rollout_logprobs is not None and (gap["tokens"] or gap["nonfinite"]):  # none measured: no metric
            metrics["rollout/logprob_diff_mean"] = (gap["sum"] / max(gap["tokens"], 1.0) if not gap["nonfinite"]
                                                    else float("nan"))
            metrics["rollout/logprob_diff_max"] = gap["max"]
            if gap["nonfinite"]:
                metrics["actor/nonfinite_samples"] = gap["nonfinite"]
        return metrics

    def generate(self, prompts, **sampling):
        """Sample responses with the transformers engine (see components.rollout.SamplingParams)."""
        engine = HFRolloutEngine(self.model, self.tokenizer)
        return engine.generate_text(prompts, SamplingParams(**sampling))

    def save_pretrained(self, output_dir: str | Path) -> None:
        self.model.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)
