"""How batches and weights move between roles: one small interface, two implementations.

Stages never touch files directly: they write and read a step's batches and publish or receive the
actor's weights through a `Transport`. Batches are always Parquet files of the run folder
(storage/schema.py). Weights go one of two ways (`trainer.weight_sync`, `weight_sync_mode`):

- `StorageTransport`: every published policy is a safetensors folder `weights/actor/<k>` committed
  atomically, which the rollout engine reads back (any process, any host).
- `MemoryTransport` (the rollout engine lives in the actor's process: `trainer.execution=local`): the
  engine gets the actor's live weights in memory, streamed in compute-dtype buckets (over CUDA IPC to
  vLLM's workers on a GPU; components/weights.py); a stored copy is written, in the background, only of
  the versions recovery and export read back: checkpoint steps, the last step (every step with
  `trainer.keep_weights=null`). A resumed run reloads the rollout from the checkpoint step's copy,
  bit for bit what the memory path had given it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Protocol

import pyarrow as pa

from components.distributed import full_state_dict, is_writer
from components.precision import save_compute_copy
from components.weights import InMemoryWeights, compute_tensors, copy_files, write_copy
from flows.config import Config, layout_for
from flows.runtime.recovery import prune_weights
from storage import COMMITTED_MARKER, RunLayout, atomic_directory, read_stage, write_stage


class Transport(Protocol):
    def write_batch(self, step: int, stage: str, columns: Mapping[str, Any]) -> str:
        """Hand on a stage's output for `step`; returns where it is."""

    def read_batch(self, step: int, stage: str, expected_uids: list[str] | None = None) -> pa.Table:
        """A stage's output for `step`, checked against the rollout's sample ids when given."""

    def publish_weights(self, model, version: int, compute_dtype) -> str:
        """Hand on the actor's weights as policy `version` (a collective when the actor is sharded)."""

    def sync_weights(self, engine, version: int) -> dict[str, float]:
        """Give `engine` the newest published policy at or before `version`, unless it holds it already."""

    def withdraw_weights(self) -> None:
        """The actor's weights are about to change: what it published last can no longer be read from it."""

    def flush(self) -> None:
        """Wait until every stored copy of the weights this process started writing is committed."""


class StorageTransport:
    """Batches and weights as files of the run folder (shared storage between processes and hosts)."""

    def __init__(self, layout: RunLayout, keep_weights: int | None = None):
        self.layout, self.keep_weights = layout, keep_weights

    def write_batch(self, step: int, stage: str, columns: Mapping[str, Any]) -> str:
        # The other ranks of a sharded role computed the same values: rank 0 alone writes.
        return write_stage(self.layout, step, stage, columns) if is_writer() else self.layout.stage_path(step, stage)

    def read_batch(self, step: int, stage: str, expected_uids: list[str] | None = None) -> pa.Table:
        return read_stage(self.layout, step, stage, expected_rows=None if expected_uids is None else len(expected_uids),
                          expected_uids=expected_uids)

    def publish_weights(self, model, version: int, compute_dtype) -> str:
        path = self.layout.weights_dir("actor", version)
        state = full_state_dict(model)  # a collective when the actor is sharded
        if is_writer():
            self._store(model, version, state, compute_dtype)
        return path

    def _store(self, model, version: int, state, compute_dtype) -> None:
        with atomic_directory(self.layout.fs, self.layout.weights_dir("actor", version)) as local:
            save_compute_copy(model, local, state, compute_dtype)  # the masters cast to the compute dtype
        # Older copies are not read again (with one_step_ahead the rollout is one copy behind).
        prune_weights(self.layout, version, self.keep_weights)

    def withdraw_weights(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def sync_weights(self, engine, version: int) -> dict[str, float]:
        # The newest committed copy at or before `version` (a resumed run may hold newer ones already).
        for candidate in range(version, -1, -1):
            path = self.layout.weights_dir("actor", candidate)
            if self.layout.fs.exists(f"{path}/{COMMITTED_MARKER}"):
                return _load_into(engine, path, candidate)
        return {}


_PUBLISHED: dict[str, InMemoryWeights] = {}
"""Run folder -> the newest policy the actor of this process published in memory."""
_COPIES: dict[str, tuple[Future, Future]] = {}
"""Run folder -> (host snapshot, write) of the stored copy of a published policy, done in the background."""
_COPIES_LOCK = threading.Lock()
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="rlhf-weights")


class MemoryTransport(StorageTransport):
    """Weights in memory to a rollout engine of this process; copies on storage only for the versions
    `stored(version)` says recovery or export read back, written in the background (see the module)."""

    def __init__(self, layout: RunLayout, keep_weights: int | None, stored):
        super().__init__(layout, keep_weights)
        self.stored = stored

    def publish_weights(self, model, version: int, compute_dtype) -> str:
        key = self.layout.run_dir
        _PUBLISHED[key] = InMemoryWeights(model, compute_dtype, version)
        if not self.stored(version):
            return f"memory://{self.layout.weights_dir('actor', version)}"
        self.flush()  # one copy in flight at most
        # Off the step's critical path: the snapshot in the compute dtype on the host (the model stays as it is
        # until withdraw_weights, which waits for it), then the writing and the atomic commit.
        files = copy_files(model, compute_dtype)
        snapshot = _WRITER.submit(lambda: {name: tensor.to("cpu", copy=True)
                                           for name, tensor in compute_tensors(model, compute_dtype, tied_once=False)})
        written = _WRITER.submit(lambda: self._write(version, files, snapshot.result()))
        with _COPIES_LOCK:
            _COPIES[key] = (snapshot, written)
        return self.layout.weights_dir("actor", version)

    def _write(self, version: int, files: dict[str, str], state) -> None:
        with atomic_directory(self.layout.fs, self.layout.weights_dir("actor", version)) as local:
            write_copy(local, files, state)
        prune_weights(self.layout, version, self.keep_weights)

    def withdraw_weights(self) -> None:
        with _COPIES_LOCK:
            pending = _COPIES.get(self.layout.run_dir)
        if pending is not None:
            pending[0].result()  # the stored copy's snapshot is taken before the model changes
        published = _PUBLISHED.pop(self.layout.run_dir, None)
        if published is not None:
            published.withdraw()

    def flush(self) -> None:
        with _COPIES_LOCK:
            pending = _COPIES.pop(self.layout.run_dir, None)
        if pending is not None:
            pending[1].result()  # a failed snapshot or write raises here: in the checkpoint or export that needed it

    def sync_weights(self, engine, version: int) -> dict[str, float]:
        published = _PUBLISHED.get(self.layout.run_dir)
        if published is None or published.version != version or not published.available:
            # Not in this process's memory (a resumed run, the initial policy): the stored copy of exactly
            # this version; an older one would be silently wrong.
            folder = self.layout.weights_dir("actor", version)

            def stored() -> bool:
                return self.layout.fs.exists(f"{folder}/{COMMITTED_MARKER}")

            if version > 0 and not stored():
                self.flush()  # it may be this process's copy still being written
                if not stored():
                    raise RuntimeError(f"policy version {version} is neither in this process's memory nor stored "
                                       f"under {folder}")
            return super().sync_weights(engine, version)
        return _load_into(engine, published, version)


def _load_into(engine, source, version: int) -> dict[str, float]:
    """Give `engine` policy `version` from `source` (a stored folder or the live model), unless it holds it."""
    if engine.weights_version == version:
        return {}
    started = time.perf_counter()
    engine.load_weights(source)
    engine.weights_version = version
    return {"timing_s/weight_sync": time.perf_counter() - started}


def weight_sync_mode(config: Config) -> str:
    """'memory' or 'storage': how the rollout engine gets the actor's weights (trainer.weight_sync, with
    auto resolved: memory when the rollout runs in the actor's process, trainer.execution=local)."""
    mode = config.trainer.weight_sync
    if mode == "auto":
        return "memory" if config.trainer.execution == "local" else "storage"
    return mode


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
    """The run's transport: weights in memory or through storage (weight_sync_mode); batches on storage."""
    layout = layout_for(config)
    if weight_sync_mode(config) == "memory":
        return MemoryTransport(layout, config.trainer.keep_weights, stored_versions(config))
    return StorageTransport(layout, config.trainer.keep_weights)
