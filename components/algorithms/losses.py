"""Token log-probabilities, entropy, and the actor / critic losses.

Shape legend: ``B`` batch of sequences, ``T`` response length (tokens), ``V`` vocab.
Every loss returns ``(loss, metrics)``: a scalar tensor and verl-named metrics as detached 0-d tensors
(no host-device sync per micro-batch; the update loop sums them on the device and reads them once).
"""

from __future__ import annotations

from typing import Callable

import torch

from components.algorithms.core import aggregate_loss, lookup, masked_mean

Metrics = dict[str, torch.Tensor]
PolicyLoss = Callable[..., tuple[torch.Tensor, Metrics]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    def decorator(function: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = function
        return function

    return decorator


def get_policy_loss(name: str, field: str = "actor.policy_loss") -> PolicyLoss:
    return lookup(POLICY_LOSSES, name, field)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label]: ``[B, T, V]`` x ``[B, T]`` -> ``[B, T]``.

    Computed in float32 because bf16 log-softmax loses enough precision to distort ratios.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)


def logprob_gap(logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|actor - rollout engine| per token ``[B, T]`` and the mask of the tokens it covers ``[B, T]``.

    Covered: response tokens whose engine log-prob exists (NaN marks samples the engine was not asked
    for, rollout.logprobs_fraction) and whose actor log-prob is finite; elsewhere the gap is 0.
    """
    measured = mask * torch.isfinite(engine_logprobs) * torch.isfinite(logprobs)
    return torch.where(measured.bool(), (logprobs - engine_logprobs).abs(), 0.0), measured


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(l) - sum_v softmax(l)_v * l_v: ``[B, T, V]`` -> ``[B, T]`` (float32)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


@register_policy_loss("ppo")
def ppo_policy_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, Metrics]:
    """Clipped PPO surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020).

    r = exp(logp - logp_old);  L = max(-A r, -A clip(r, 1 - low, 1 + high));
    for A < 0 additionally L = min(L, -A c), which bounds the loss when r explodes.
    Inputs ``[B, T]``; returns a scalar loss aggregated with ``loss_agg_mode``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c={clip_ratio_c} must be greater than 1.0 for dual-clip PPO")
    mask = response_mask.float()
    # Clamping keeps exp() finite when the policy drifted far from the rollout policy.
    negative_approx_kl = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3).float() * (advantages < 0).float(), mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = aggregate_loss(pg_losses, mask, loss_agg_mode)
    metrics = {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": pg_clipfrac,
        "actor/pg_clipfrac_lower": pg_clipfrac_lower,
        "actor/ppo_kl": masked_mean(-negative_approx_kl.detach(), mask),
    }
    return loss, metrics


def value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss (verl): 0.5 * agg(max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)).

    Clipping keeps the critic from moving further than ``c`` from its rollout-time value.
    Inputs ``[B, T]``; returns a scalar loss.
    """
    mask = response_mask.float()
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(vf_losses1, vf_losses2), mask, loss_agg_mode)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask),
        "critic/vpred_mean": masked_mean(values.detach(), mask),
    }
    return loss, metrics
