"""Masked tensor statistics and loss aggregation shared by the RL algorithms.

Shape legend: ``B`` batch of sequences, ``T`` response length (tokens), ``V`` vocab.
Masks are ``[B, T]`` float or bool tensors with 1 for real response tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

LossAggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def lookup(registry: dict, name: str, field: str):
    """Shared registry lookup so every unknown-name error reads the same way."""
    if name not in registry:
        valid = ", ".join(sorted(registry))
        raise ValueError(f"{field}={name!r} is not one of: {valid}")
    return registry[name]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask), over ``dim`` or over everything when ``dim`` is None."""
    product = values * mask.float()
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(v * m) / (sum(m) + 1e-8), as verl does.

    The epsilon (rather than clamping the count at 1) keeps the mean unbiased for
    fractional masks while still returning 0 for an all-masked input.
    """
    return masked_sum(values, mask, dim) / (masked_sum(torch.ones_like(values), mask, dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Masked variance: mean((v - mean)^2), times n / (n - 1) when ``unbiased`` (verl)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.float().sum()
        if count <= 1:
            # Bessel's correction is undefined for one sample; verl raises here, but a
            # zero-variance answer lets whitening degrade gracefully on tiny batches.
            return torch.zeros_like(variance)
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(v - mean) * rsqrt(var + 1e-8); the mean is added back when ``shift_mean`` is False."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return whitened if shift_mean else whitened + mean


def register_loss_aggregation(name: str) -> Callable[[LossAggregation], LossAggregation]:
    def decorator(function: LossAggregation) -> LossAggregation:
        LOSS_AGGREGATIONS[name] = function
        return function

    return decorator


@register_loss_aggregation("token-mean")
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over all valid tokens of the batch: long sequences weigh more. ``[B, T] -> []``."""
    return masked_mean(loss_mat, mask)


@register_loss_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of the per-sequence token sum (Dr. GRPO style). ``[B, T] -> []``."""
    return masked_sum(loss_mat, mask, dim=-1).mean()


@register_loss_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of the per-sequence token mean (original GRPO). ``[B, T] -> []``.

    Empty sequences divide by 1 so they contribute 0 instead of NaN.
    """
    per_sequence = masked_sum(loss_mat, mask, dim=-1) / mask.float().sum(dim=-1).clamp(min=1)
    return per_sequence.mean()


def get_loss_aggregation(mode: str, field: str = "actor.loss_agg_mode") -> LossAggregation:
    return lookup(LOSS_AGGREGATIONS, mode, field)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar with the named aggregation ``mode``."""
    return get_loss_aggregation(mode)(loss_mat, mask)
