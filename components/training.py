"""The optimisation loop shared by the actor and the critic.

PPO-style updates: `epochs` passes over the step's batch, shuffled into mini-batches (one optimizer
step each), each split into micro-batches whose gradients accumulate. A mini-batch whose gradient
norm is not finite is skipped (the optimizer does not step), and counted, instead of poisoning the
weights: the classic silent failure of bf16 RL runs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch
from pydantic import Field

from components.distributed import is_distributed, local_rows, scalar, world_size
from components.precision import parameter_change_ratio
from components.settings import Section


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""


def make_optimizer(model: torch.nn.Module, optim_config) -> tuple[torch.optim.Optimizer, object]:
    """AdamW with a linear warm-up schedule (constant after warm-up).

    On CUDA, PyTorch's fused AdamW (one kernel over every parameter) unless the parameters are sharded
    DTensors; elsewhere the default (for-each) implementation. Both compute the same update."""
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    fused = bool(parameters) and all(parameter.is_cuda and type(parameter) is torch.nn.Parameter
                                     for parameter in parameters)
    optimizer = torch.optim.AdamW(
        parameters,
        lr=optim_config.lr,
        betas=tuple(optim_config.betas),
        weight_decay=optim_config.weight_decay,
        **({"fused": True} if fused else {}),
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
    row_weights: torch.Tensor | None = None,
    row_lengths: torch.Tensor | None = None,
) -> dict[str, float]:
    """Run the update; `micro_loss(indices)` returns (loss, metrics) for those batch rows.

    Metrics may be floats or 0-d tensors; tensors are summed where they are and read once at the end,
    so that the micro-batch loop never waits for the GPU (one sync per optimizer step: the grad norm).

    Each micro-batch loss is scaled by its share of the mini-batch's weight (`row_weights[B]`:
    valid tokens per row for token-mean losses, 1 per row otherwise), so that accumulated gradients
    equal those of the whole mini-batch. `row_lengths[B]` (real tokens per row), when given, orders each
    mini-batch's rows by length before it is split, so that micro-batches hold rows of similar length
    (the gradient is the same: it is accumulated over the mini-batch). Returns metrics averaged over micro-batches, plus
    `<prefix>/grad_norm` and `<prefix>/update_rms_ratio` (the parameters' relative change, update_rms_ratio;
    both averaged over optimizer steps), `<prefix>/lr` (the rate the last step used) and `<prefix>/skipped_steps`.
    """
    row_weights = torch.ones(batch_size) if row_weights is None else row_weights.float()
    model.train()
    generator = torch.Generator().manual_seed(seed)
    sums: dict[str, float | torch.Tensor] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    skipped = 0
    last_lr = optimizer.param_groups[0]["lr"]
    on_cuda = next(model.parameters()).is_cuda
    for _ in range(epochs):
        order = torch.randperm(batch_size, generator=generator)
        for mini in order.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            # Sharded (FSDP) ranks each take their share of the mini-batch; every rank makes the same
            # number of forward/backward calls (they are collectives), hence the equal-count split.
            local = local_rows(mini)
            if row_lengths is not None:  # similar lengths share a micro-batch: less padding to compute
                local = local[torch.argsort(row_lengths[local], descending=True, stable=True)]
            if on_cuda:
                local = local.pin_memory()  # its slices go to the device without a sync (device_rows)
            chunks = max(1, math.ceil(len(mini) / world_size() / micro_batch_size))
            mini_weight = float(row_weights[local].sum().clamp(min=1e-8))
            for micro in local.tensor_split(chunks):
                loss, metrics = micro_loss(micro)
                (loss * (float(row_weights[micro].sum()) / mini_weight)).backward()
                for name, value in metrics.items():  # 0-d tensors stay on the device: no sync here
                    sums[name] = sums[name] + (value.detach().float() if torch.is_tensor(value) else float(value))
                    counts[name] += 1
            grad_norm = scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
            if not math.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            last_lr = optimizer.param_groups[0]["lr"]
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            before = [parameter.detach().clone() for parameter in parameters]
            optimizer.step()
            scheduler.step()
            sums[f"{prefix}/update_rms_ratio"] = sums[f"{prefix}/update_rms_ratio"] + update_rms_ratio(parameters, before)
            del before
            counts[f"{prefix}/update_rms_ratio"] += 1
            sums[f"{prefix}/grad_norm"] += grad_norm
            counts[f"{prefix}/grad_norm"] += 1
    model.eval()
    result = {name: float(sums[name]) / counts[name] for name in sums}  # the update's one read of its metrics
    result.setdefault(f"{prefix}/update_rms_ratio", 0.0)  # every step skipped: nothing moved
    result[f"{prefix}/lr"] = last_lr
    result[f"{prefix}/skipped_steps"] = float(skipped)
    return result


def update_rms_ratio(parameters: list[torch.Tensor], before: list[torch.Tensor]) -> torch.Tensor:
    """RMS(change) / RMS(parameters) of one optimizer step, a 0-d tensor on the device (no sync).

    sqrt(sum (p - p_before)^2 / sum p^2) over every trained parameter (the element counts cancel); over all
    ranks when sharded. A policy whose updates vanish (pure-bf16 AdamW at a small learning rate) shows 0."""
    change, size = parameter_change_ratio(parameters, before)
    if is_distributed():
        totals = torch.stack([change, size])
        torch.distributed.all_reduce(totals)
        change, size = totals[0], totals[1]
    return (change / size.clamp(min=1e-30)).sqrt()


def to_device(device: torch.device, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The update's per-row inputs on the model's device, copied once before the micro-batch loop (each
    copy from pageable host memory may wait for the GPU; slicing on the device does not)."""
    return [None if tensor is None else tensor.to(device) for tensor in tensors]


def micro_rows(tensor: torch.Tensor | None, rows: torch.Tensor, width: int) -> torch.Tensor | None:
    """A per-token tensor `[B, T]` cut to a micro-batch: its rows, and its first `width` columns."""
    return None if tensor is None else tensor[rows, :width]


def device_rows(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch's row indices on the device (run_updates pins them, so the copy does not wait)."""
    return indices.to(device, non_blocking=indices.is_pinned())


def loss_row_weights(response_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Weight of each row `[B]` in a mini-batch loss: its valid tokens for token-mean, else 1."""
    if loss_agg_mode == "token-mean":
        return response_mask.sum(-1)
    return torch.ones(response_mask.shape[0])


class Updater:
    """A model's optimizer, schedule and update count, shared by the actor and the critic.

    `config` is an ActorConfig or CriticConfig (optim, ppo_epochs, ppo_mini_batch_size in prompts,
    micro_batch_size, loss_agg_mode); `samples_per_prompt` (rollout.n) turns the mini-batch into samples.
    The optimizer is made on the first update, after any sharding.
    """

    def __init__(self, model: torch.nn.Module, config, seed: int, samples_per_prompt: int = 1):
        self.model, self.config, self.seed = model, config, seed
        self.mini_batch_samples = config.ppo_mini_batch_size * samples_per_prompt
        self.updates = 0
        self.optimizer = None
        self.scheduler = None

    def update(self, response_mask: torch.Tensor, micro_loss, prefix: str,
               row_lengths: torch.Tensor | None = None) -> dict[str, float]:
        config = self.config
        if self.optimizer is None:
            self.optimizer, self.scheduler = make_optimizer(self.model, config.optim)
        metrics = run_updates(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, batch_size=response_mask.shape[0],
            mini_batch_size=self.mini_batch_samples, micro_batch_size=config.micro_batch_size,
            epochs=config.ppo_epochs, grad_clip=config.optim.grad_clip, seed=self.seed + self.updates,
            micro_loss=micro_loss, prefix=prefix, row_weights=loss_row_weights(response_mask, config.loss_agg_mode),
            row_lengths=row_lengths,
        )
        self.updates += 1
        return metrics
