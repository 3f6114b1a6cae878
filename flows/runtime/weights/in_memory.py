"""Weights in memory to a rollout engine of the actor's own process (trainer.execution=local): the engine gets
the actor's live weights, streamed in compute-dtype buckets (over CUDA IPC to vLLM's workers on a GPU;
components/weight_sync/buckets.py). A stored copy is written, in the background, only of the versions recovery
and export read back: checkpoint steps, the last step (every step with `trainer.keep_weights=null`). A resumed
run reloads the rollout from the checkpoint step's copy, bit for bit what the memory path had given it. The
copy's snapshot waits until the version was handed to the rollout (flows/runtime/weights/stored_copy.py).
"""

from __future__ import annotations

from components.protocols import RolloutRole
from components.weight_sync.buckets import compute_tensors
from components.weight_sync.versions import InMemoryWeights, copy_files, write_copy
from flows.runtime.recovery import prune_weights
from flows.runtime.weights.on_storage import STORED_COPY_WAIT_S, StorageTransport, load_into
from flows.runtime.weights.stored_copy import claim, copy_due, release, start_copy
from storage import RunLayout, atomic_directory

_PUBLISHED: dict[str, InMemoryWeights] = {}
"""Run folder -> the newest policy the actor of this process published in memory."""


class MemoryTransport(StorageTransport):
    """Weights in memory to a rollout engine of this process; copies on storage only for the versions
    `stored(version)` says recovery or export read back, written in the background (see the module)."""

    def __init__(self, layout: RunLayout, keep_weights: int | None, stored, checkpoint_every: int = 1):
        super().__init__(layout, keep_weights)
        self.stored, self.checkpoint_every = stored, checkpoint_every

    def publish_weights(self, model, version: int, compute_dtype) -> str:
        key = self.layout.run_dir
        _PUBLISHED[key] = InMemoryWeights(model, compute_dtype, version)
        if not self.stored(version):
            return f"memory://{self.layout.weights_dir('actor', version)}"
        self.flush()  # one copy in flight at most
        # Off the step's critical path, after the hand-over (stored_copy.py): the snapshot in the compute dtype on
        # the host (the model stays as it is until withdraw_weights, which waits for it), then the writing and
        # the atomic commit. A reader in another process waits for it while this process lives.
        claim(self.layout.fs, self.writer_path(version))
        files = copy_files(model, compute_dtype)
        start_copy(key, version, lambda: {name: tensor.to("cpu", copy=True)
                                          for name, tensor in compute_tensors(model, compute_dtype, tied_once=False)},
                   lambda state: self._write(version, files, state))
        return self.layout.weights_dir("actor", version)

    def _write(self, version: int, files: dict[str, str], state) -> None:
        try:
            with atomic_directory(self.layout.fs, self.layout.weights_dir("actor", version)) as local:
                write_copy(local, files, state)
        finally:  # committed, or failed (this process raises it where the copy is needed): no longer being written
            release(self.layout.fs, self.writer_path(version))
        prune_weights(self.layout, version, self.keep_weights)

    def handed_over(self, version: int) -> None:
        """The rollout holds `version`: its stored copy may be made now."""
        copy_due(self.layout.run_dir, version)

    def withdraw_weights(self) -> None:
        pending = copy_due(self.layout.run_dir)
        if pending is not None:
            pending.snapshot.result()  # the stored copy's snapshot is taken before the model changes
        published = _PUBLISHED.pop(self.layout.run_dir, None)
        if published is not None:
            published.withdraw()

    def flush(self) -> None:
        pending = copy_due(self.layout.run_dir, pop=True)
        if pending is not None:
            pending.written.result()  # a failed snapshot or write raises here: in the checkpoint or export that needed it

    def sync_weights(self, engine: RolloutRole, version: int, sync: str | None = None) -> dict[str, float]:
        published = _PUBLISHED.get(self.layout.run_dir)
        if published is None or published.version != version or not published.available:
            return self._stored_exactly(engine, version)
        metrics = load_into(engine, published, version)
        self.handed_over(version)
        return metrics

    def _stored_exactly(self, engine: RolloutRole, version: int, why: str = "it is not in this process's memory") -> dict:
        """The stored copy of exactly `version` (a resumed run, a stream that failed; an older copy would be
        silently wrong); the initial policy (version 0) is the engine's own or weights/actor/0."""
        if version == 0:
            return StorageTransport.sync_weights(self, engine, 0)
        if engine.weights_version == version and not needs_reload(engine):
            return {}
        try:
            # a copy another process writes in the background is waited for only when one is due
            folder = self.committed_copy(version, STORED_COPY_WAIT_S if self.stored(version) else 0.0)
        except RuntimeError as error:
            raise RuntimeError(
                f"policy version {version} cannot reach the rollout: {why}, and it has no stored copy "
                f"({error}; copies are kept for checkpoint steps, trainer.checkpoint_every="
                f"{self.checkpoint_every}); `rlhf resume {self.layout.run_name}` restarts from the latest checkpoint"
            ) from None
        return load_into(engine, folder, version)


def needs_reload(engine: RolloutRole) -> bool:
    """A sleeping engine whose weights were streamed (not stored) lost them: they must come again."""
    return engine.asleep and engine.weights_path is None
