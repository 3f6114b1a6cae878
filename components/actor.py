"""The actor: the policy being trained (an HF causal LM), its log-probs and its PPO update.

Usable on its own:

    actor = Actor.from_pretrained("path/or/hub-name")
    generations = actor.generate(["12+34="], n=4, max_new_tokens=8)
"""

from __future__ import annotations

from pathlib import Path

import torch

from components.algorithms import aggregate_loss, entropy_from_logits, get_policy_loss, kl_loss, logprobs_from_logits
from components.batch import SequenceBatch, response_logits
from components.models import load_causal_lm, load_tokenizer
from components.training import Updater


@torch.no_grad()
def sequence_logprobs(
    model, batch: SequenceBatch, *, temperature: float, micro_batch_size: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs `[B, T]` of the batch's response tokens (and entropies `[B, T]`), masked to 0."""
    model.eval()
    device = next(model.parameters()).device
    logprob_parts, entropy_parts = [], []
    for start in range(0, batch.size, micro_batch_size):
        micro = batch.select(slice(start, start + micro_batch_size)).to(device)
        logits = response_logits(model, micro, temperature)
        logprob_parts.append((logprobs_from_logits(logits, micro.response_ids) * micro.response_mask).cpu())
        if with_entropy:
            entropy_parts.append((entropy_from_logits(logits) * micro.response_mask).cpu())
    entropy = torch.cat(entropy_parts) if with_entropy else None
    return torch.cat(logprob_parts), entropy


class Actor:
    """Policy model + optimizer. `temperature` must match the rollout's sampling temperature."""

    def __init__(self, model, tokenizer, config=None, *, temperature: float = 1.0, seed: int = 0):
        from flows.config import ActorConfig

        self.model = model
        self.tokenizer = tokenizer
        self.config = config or ActorConfig()
        self.temperature = temperature
        self.updater = Updater(model, self.config, seed)

    @classmethod
    def from_pretrained(cls, path: str, config=None, *, dtype="float32", device="auto",
                        attn_implementation="auto", trust_remote_code=False, temperature=1.0, seed=0):
        model = load_causal_lm(path, dtype=dtype, device=device, attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, config, temperature=temperature, seed=seed)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def compute_logprobs(self, batch: SequenceBatch, with_entropy: bool = False):
        return sequence_logprobs(self.model, batch, temperature=self.temperature,
                                 micro_batch_size=self.config.micro_batch_size, with_entropy=with_entropy)

    def update(self, batch: SequenceBatch, *, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One PPO update over the batch (all inputs `[B, T]`); returns `actor/*` metrics."""
        config = self.config
        if config.use_kl_loss and ref_logprobs is None:
            raise ValueError("actor.use_kl_loss=true needs reference log-probs")
        policy_loss = get_policy_loss(config.policy_loss)
        device = self.device

        def micro_loss(indices: torch.Tensor):
            micro = batch.select(indices).to(device)
            logits = response_logits(self.model, micro, self.temperature)
            logprobs = logprobs_from_logits(logits, micro.response_ids)
            loss, metrics = policy_loss(
                logprobs=logprobs, old_logprobs=old_logprobs[indices].to(device),
                advantages=advantages[indices].to(device), response_mask=micro.response_mask,
                clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode,
            )
            # A metric unless entropy_coeff is set: then no autograd graph over the [b, T, V] softmax.
            with torch.set_grad_enabled(bool(config.entropy_coeff) and torch.is_grad_enabled()):
                entropy = aggregate_loss(entropy_from_logits(logits), micro.response_mask, config.loss_agg_mode)
            metrics["actor/entropy"] = float(entropy.detach())
            if config.entropy_coeff:
                loss = loss - config.entropy_coeff * entropy
            if config.use_kl_loss:
                kl_term, kl_metrics = kl_loss(
                    logprobs=logprobs, ref_logprobs=ref_logprobs[indices].to(device),
                    response_mask=micro.response_mask, estimator=config.kl_loss_type,
                    loss_agg_mode=config.loss_agg_mode,
                )
                loss = loss + config.kl_loss_coef * kl_term
                metrics.update(kl_metrics)
            return loss, metrics

        return self.updater.update(batch.response_mask, micro_loss, prefix="actor")

    def generate(self, prompts, **sampling):
        """Sample responses with the transformers engine (see components.rollout.SamplingParams)."""
        from components.rollout import HFRolloutEngine, SamplingParams

        engine = HFRolloutEngine(self.model, self.tokenizer)
        return engine.generate_text(prompts, SamplingParams(**sampling))

    def save_pretrained(self, output_dir: str | Path) -> None:
        self.model.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)
