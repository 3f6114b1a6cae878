"""The weight sync protocol (`Transport`) and the run's choice of its implementation (`transport_for`).

Stages never touch weight files directly: they publish or receive the actor's weights through a `Transport`.
Weights go one of three ways (`trainer.weight_sync`, `weight_sync_mode`): `StorageTransport` (on_storage.py),
`MemoryTransport` (in_memory.py: the rollout engine lives in the actor's process) and `StreamTransport`
(streamed.py: between workers).
"""

from __future__ import annotations

from typing import Protocol

from components.protocols import RolloutRole
from flows.config import Config, layout_for
from flows.runtime.weights.in_memory import MemoryTransport
from flows.runtime.weights.on_storage import StorageTransport
from flows.runtime.weights.streamed import StreamTransport


class Transport(Protocol):
    def publish_weights(self, model, version: int, compute_dtype) -> str:
        """Hand on the actor's weights as policy `version` (a collective when the actor is sharded)."""

    def sync_weights(self, engine: RolloutRole, version: int, sync: str | None = None) -> dict[str, float]:
        """Give `engine` the newest published policy at or before `version`, unless it holds it already
        (`sync`: the driver's name for this hand-over, when the actor's worker streams it: `streams`)."""

    def streams(self, version: int) -> bool:
        """Whether the actor's worker must send `version` (its sender stage) while the rollout syncs."""

    def send_weights(self, model, version: int, compute_dtype, sync: str, holds: bool,
                     finished=lambda: False) -> dict[str, float]:
        """The actor's side of a streamed hand-over (every rank of a sharded actor calls it), until the
        receiver is done or `finished()`."""

    def abandon(self, sync: str) -> None:
        """The driver gives a streamed hand-over up (its stage failed): a sender still waiting returns."""

    def committed_copy(self, version: int, timeout_s: float) -> str:
        """The stored copy of `version` once committed (written by this or another process); raises if none."""

    def withdraw_weights(self) -> None:
        """The actor's weights are about to change: what it published last can no longer be read from it."""

    def flush(self) -> None:
        """Wait until every stored copy of the weights this process started writing is committed."""


def weight_sync_mode(config: Config) -> str:
    """'memory' or 'storage': how the rollout engine gets the actor's weights (trainer.weight_sync; auto is
    memory: in the actor's process under trainer.execution=local, streamed between workers otherwise)."""
    mode = config.trainer.weight_sync
    return "memory" if mode == "auto" else mode


def stored_versions(config: Config):
    """Which published policy versions get a stored copy under memory weight sync: those a checkpoint
    starts from (a resumed run reloads the rollout from them), the last one (export, the MLflow model,
    model.from_run), every one with trainer.keep_weights=null."""
    trainer = config.trainer

    def stored(version: int) -> bool:
        return (trainer.keep_weights is None or version == trainer.total_steps
                or bool(trainer.checkpoint_every and version % trainer.checkpoint_every == 0))
    return stored


def transport_for(config: Config) -> Transport:
    """The run's transport: weights in memory (in process or streamed between workers) or through storage
    (weight_sync_mode). Batches: flows/runtime/batches.py."""
    layout, trainer = layout_for(config), config.trainer
    if weight_sync_mode(config) == "storage":
        return StorageTransport(layout, trainer.keep_weights)
    if trainer.execution == "local":
        return MemoryTransport(layout, trainer.keep_weights, stored_versions(config), trainer.checkpoint_every)
    return StreamTransport(layout, trainer.keep_weights, stored_versions(config), timeout_s=trainer.stage_timeout_s,
                           bucket_bytes=config.rollout.update_weights_bucket_megabytes * 2**20,
                           checkpoint_every=trainer.checkpoint_every, connect_timeout_s=trainer.worker_wait_s)
