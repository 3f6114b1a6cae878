"""KL estimators between policy and reference, KL controllers, and KL penalty / loss.

Shape legend: ``B`` batch of sequences, ``T`` response length (tokens), ``V`` vocab.
Estimator names follow Schulman, "Approximating KL Divergence" (2020), with verl aliases.
"""

from __future__ import annotations

from typing import Callable

import torch

from components.algorithms.core import aggregate_loss, lookup, masked_mean

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {}


def register_kl_estimator(*names: str) -> Callable[[KLEstimator], KLEstimator]:
    """Register one estimator under a name and any aliases."""

    def decorator(function: KLEstimator) -> KLEstimator:
        for name in names:
            KL_ESTIMATORS[name] = function
        return function

    return decorator


def get_kl_estimator(name: str, field: str = "algorithm.kl_estimator") -> KLEstimator:
    return lookup(KL_ESTIMATORS, name, field)


@register_kl_estimator("k1", "kl")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log p - log p_ref: unbiased, high variance, can be negative. ``[B, T]``."""
    return logprobs - ref_logprobs


@register_kl_estimator("abs")
def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """|log p - log p_ref|. ``[B, T]``."""
    return (logprobs - ref_logprobs).abs()


@register_kl_estimator("k2", "mse")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log p - log p_ref)^2: biased, low variance, non-negative. ``[B, T]``."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = log p_ref - log p: unbiased, low variance. ``[B, T]``.

    Like verl, d is clamped to [-20, 20] and the result to [-10, 10] so one outlier
    token cannot dominate the gradient.
    """
    log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10.0, max=10.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` with the named estimator."""
    return get_kl_estimator(estimator)(logprobs, ref_logprobs)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Adaptive coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    e = clip(KL / target - 1, -0.2, 0.2);  coef *= 1 + e * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        super().__init__(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


KLControllerFactory = Callable[..., FixedKLController]
KL_CONTROLLERS: dict[str, KLControllerFactory] = {}


def register_kl_controller(name: str) -> Callable[[KLControllerFactory], KLControllerFactory]:
    def decorator(factory: KLControllerFactory) -> KLControllerFactory:
        KL_CONTROLLERS[name] = factory
        return factory

    return decorator


@register_kl_controller("fixed")
def _make_fixed(kl_coef: float, target_kl: float | None, horizon: float | None) -> FixedKLController:
    return FixedKLController(kl_coef)


@register_kl_controller("adaptive")
def _make_adaptive(kl_coef: float, target_kl: float | None, horizon: float | None) -> AdaptiveKLController:
    if target_kl is None or horizon is None:
        raise ValueError("algorithm.kl_ctrl.type='adaptive' needs both target_kl and horizon")
    if target_kl <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None,
    field: str = "algorithm.kl_ctrl.type",
) -> FixedKLController:
    """Build the KL controller registered as ``kind`` (``"fixed"`` or ``"adaptive"``)."""
    return lookup(KL_CONTROLLERS, kind, field)(kl_coef, target_kl, horizon)


def apply_kl_penalty(
    *,
    token_level_scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """In-reward KL penalty: r_t = score_t - beta * KL_t on valid tokens. ``[B, T]``.

    The reported KL is the mean over sequences of each sequence's token-mean KL (verl).
    """
    mask = response_mask.float()
    kl = kl_penalty(logprobs, ref_logprobs, estimator) * mask
    token_rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, mask, dim=-1).mean()
    metrics = {"actor/reward_kl_penalty": current_kl.item(), "actor/reward_kl_penalty_coeff": float(kl_coef)}
    return token_rewards, metrics


def kl_loss(
    *,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-as-loss (GRPO style): agg(KL_t) over valid tokens; returns a scalar and its detached value as the metric.
    Inputs ``[B, T]``."""
    loss = aggregate_loss(kl_penalty(logprobs, ref_logprobs, estimator), response_mask, loss_agg_mode)
    return loss, {"actor/kl_loss": loss.detach()}
