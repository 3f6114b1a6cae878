"""Advantage estimators: turn per-token rewards into per-token advantages and returns.

Shape legend: ``B`` batch of sequences, ``T`` response length (tokens), ``V`` vocab.
Every estimator shares one keyword-only signature so the trainer can call any of them:
``fn(*, token_rewards, response_mask, values=None, group_ids=None, gamma=1.0, lam=1.0,
epsilon=1e-6) -> (advantages [B, T], returns [B, T])``, both zero outside the mask.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable, Sequence

import torch

from components.algorithms.core import lookup, masked_whiten

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
# Only these estimators read `values`; the flow can skip the critic for all others.
ESTIMATORS_NEEDING_CRITIC = frozenset({"gae"})


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    def decorator(function: AdvantageEstimator) -> AdvantageEstimator:
        ADVANTAGE_ESTIMATORS[name] = function
        return function

    return decorator


def get_advantage_estimator(name: str, field: str = "algorithm.adv_estimator") -> AdvantageEstimator:
    return lookup(ADVANTAGE_ESTIMATORS, name, field)


def sequence_scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score ``[B]`` on its last valid response token, giving ``[B, T]``.

    The last valid token is the mask's last 1: ``mask.sum(-1) - 1`` under right padding (verl), and still the
    policy's last token when a multi-turn loss mask has holes (a tool's answer). Sequences with an empty
    response receive no reward.
    """
    mask = response_mask.float()
    token_rewards = torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    last = ((mask > 0) * positions).amax(dim=-1) if mask.numel() else torch.zeros(mask.shape[0], dtype=torch.long)
    rows = torch.nonzero(last > 0, as_tuple=True)[0]
    token_rewards[rows, last[rows] - 1] = scores[rows].float()
    return token_rewards


def compute_gae_raw(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Unwhitened GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE").

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
    with V and A beyond the last valid token equal to 0. Masked tokens carry the next
    value and advantage through unchanged, so padding never leaks into the recursion.
    Shapes: all ``[B, T]``.
    """
    mask = response_mask.float()
    rewards, values = token_rewards * mask, values * mask
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    reversed_advantages = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        next_advantage = advantage * mask[:, t] + (1 - mask[:, t]) * next_advantage
        reversed_advantages.append(next_advantage)
    return torch.stack(reversed_advantages[::-1], dim=1) * mask


@register_advantage_estimator("gae")
def gae(*, token_rewards, response_mask, values=None, group_ids=None, gamma=1.0, lam=1.0, epsilon=1e-6):
    """GAE advantages whitened over the batch; returns = A_raw + V (before whitening). ``[B, T]``."""
    if values is None:
        raise ValueError("algorithm.adv_estimator='gae' needs critic values, but values is None")
    mask = response_mask.float()
    raw_advantages = compute_gae_raw(token_rewards, values, mask, gamma, lam)
    returns = (raw_advantages + values) * mask
    return masked_whiten(raw_advantages, mask) * mask, returns


def _group_rows(group_ids: Sequence[Hashable] | None, batch_size: int) -> list[list[int]]:
    if group_ids is None:
        raise ValueError("group-based advantage estimators need group_ids (one per sequence), got None")
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries but the batch has {batch_size} sequences")
    rows_by_group: dict[Hashable, list[int]] = defaultdict(list)
    for row, group_id in enumerate(group_ids):
        rows_by_group[group_id].append(row)
    return list(rows_by_group.values())


def equal_group_fraction(scores: Sequence[float], group_ids: Sequence[Hashable]) -> float | None:
    """The share of prompt groups whose samples all got the same score: ``critic/score/equal_group_frac``.

    frac = |{g : |g| >= 2, max_{i in g} s_i = min_{i in g} s_i}| / |{g : |g| >= 2}|, over the groups ``g`` of
    rows sharing a group id, ``s`` the sequence scores ``[B]`` (exact equality). Such a group gives GRPO, Dr.
    GRPO and RLOO no advantage (s_i - mean_g = 0), and for any estimator its samples show nothing to prefer:
    at 1.0 the step's rewards carry no learning signal. A group of one (rollout.n=1, as PPO often runs) has
    nothing to compare with and is left out; None when no group has two samples (the metric is not logged).
    """
    groups = [rows for rows in _group_rows(group_ids, len(scores)) if len(rows) > 1]
    if not groups:
        return None
    equal = sum(max(scores[row] for row in rows) == min(scores[row] for row in rows) for rows in groups)
    return equal / len(groups)


def _outcome_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return (token_rewards * response_mask.float()).sum(dim=-1)


def _group_normalized(token_rewards, response_mask, group_ids, epsilon, divide_by_std):
    """(score - group mean) [/ (group std + epsilon)], broadcast over valid tokens.

    A group of one has no peers to compare against; like verl it gets mean 0 and std 1,
    so its raw score passes through.
    """
    scores = _outcome_scores(token_rewards, response_mask)
    normalized = scores.clone()
    for rows in _group_rows(group_ids, scores.shape[0]):
        if len(rows) == 1:
            mean, std = scores.new_tensor(0.0), scores.new_tensor(1.0)
        else:
            mean, std = scores[rows].mean(), scores[rows].std()
        shifted = scores[rows] - mean
        normalized[rows] = shifted / (std + epsilon) if divide_by_std else shifted
    advantages = normalized.unsqueeze(-1) * response_mask.float()
    return advantages, advantages


@register_advantage_estimator("grpo")
def grpo(*, token_rewards, response_mask, values=None, group_ids=None, gamma=1.0, lam=1.0, epsilon=1e-6):
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (s_i - mean_g) / (std_g + eps), unbiased std.

    ``s_i = sum_t r_{i,t}``; broadcast over the sequence's tokens. Shapes ``[B, T]``.
    """
    return _group_normalized(token_rewards, response_mask, group_ids, epsilon, divide_by_std=True)


@register_advantage_estimator("grpo_no_std")
def grpo_no_std(*, token_rewards, response_mask, values=None, group_ids=None, gamma=1.0, lam=1.0, epsilon=1e-6):
    """Dr. GRPO (Liu et al. 2025): A_i = s_i - mean_g; dropping the std avoids a difficulty bias."""
    return _group_normalized(token_rewards, response_mask, group_ids, epsilon, divide_by_std=False)


@register_advantage_estimator("rloo")
def rloo(*, token_rewards, response_mask, values=None, group_ids=None, gamma=1.0, lam=1.0, epsilon=1e-6):
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean_g).

    A group of one has no leave-one-out baseline; following verl its raw score is kept.
    Shapes ``[B, T]``.
    """
    scores = _outcome_scores(token_rewards, response_mask)
    advantages_per_sequence = scores.clone()
    for rows in _group_rows(group_ids, scores.shape[0]):
        count = len(rows)
        if count > 1:
            advantages_per_sequence[rows] = (scores[rows] - scores[rows].mean()) * count / (count - 1)
    advantages = advantages_per_sequence.unsqueeze(-1) * response_mask.float()
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus(
    *, token_rewards, response_mask, values=None, group_ids=None, gamma=1.0, lam=1.0, epsilon=1e-6
):
    """REINFORCE++ (Hu 2025): G_t = sum_{s >= t} gamma^(s - t) r_s; A = whiten(G) over the batch.

    The running return resets to 0 at every masked token, so rewards never flow back
    across a mask boundary. Returns are the discounted G. Shapes ``[B, T]``.
    """
    mask = response_mask.float()
    rewards = token_rewards * mask
    returns = torch.zeros_like(rewards)
    running_return = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running_return = (rewards[:, t] + gamma * running_return) * mask[:, t]
        returns[:, t] = running_return
    return masked_whiten(returns, mask) * mask, returns
