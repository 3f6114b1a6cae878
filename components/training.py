"""The optimisation loop shared by the actor and the critic.

PPO-style updates: `epochs` passes over the step's batch, shuffled into mini-batches (one optimizer
step each), each split into micro-batches whose gradients accumulate. A mini-batch whose gradient
norm is not finite is skipped (the optimizer does not step), and counted, instead of poisoning the
weights: the classic silent failure of bf16 RL runs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch


def make_optimizer(model: torch.nn.Module, optim_config) -> tuple[torch.optim.Optimizer, object]:
    """AdamW with a linear warm-up schedule (constant after warm-up)."""
    optimizer = torch.optim.AdamW(
        [parameter for parameter in model.parameters() if parameter.requires_grad],
        lr=optim_config.lr,
        betas=tuple(optim_config.betas),
        weight_decay=optim_config.weight_decay,
    )
    warmup = max(optim_config.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def run_updates(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch_size: int,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    grad_clip: float,
    seed: int,
    micro_loss: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    prefix: str,
) -> dict[str, float]:
    """Run the update; `micro_loss(indices)` returns (loss, metrics) for those batch rows.

    Each micro-batch loss is scaled by its share of the mini-batch so that accumulated gradients
    equal those of one mini-batch. Returns metrics averaged over micro-batches, plus
    `<prefix>/grad_norm`, `<prefix>/lr` and `<prefix>/skipped_steps`.
    """
    model.train()
    generator = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    skipped = 0
    for _ in range(epochs):
        order = torch.randperm(batch_size, generator=generator)
        for mini in order.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            for micro in mini.split(micro_batch_size):
                loss, metrics = micro_loss(micro)
                (loss * (len(micro) / len(mini))).backward()
                for name, value in metrics.items():
                    sums[name] += float(value)
                    counts[name] += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            sums[f"{prefix}/grad_norm"] += float(grad_norm)
            counts[f"{prefix}/grad_norm"] += 1
    model.eval()
    result = {name: sums[name] / counts[name] for name in sums}
    result[f"{prefix}/lr"] = optimizer.param_groups[0]["lr"]
    result[f"{prefix}/skipped_steps"] = float(skipped)
    return result
