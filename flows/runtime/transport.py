"""How batches and weights move between roles: one small interface, today's implementation on storage.

Stages never touch files directly: they write and read a step's batches and publish or receive the
actor's weights through a `Transport`. `StorageTransport` (the only one today) keeps both as files of
the run folder: Parquet batches (storage/schema.py) and safetensors weight folders committed atomically,
which is also what makes a run resumable. An in-memory weight path (CUDA IPC, NCCL, or the engine's
`load_weights` in the same process) is another implementation of `publish_weights`/`sync_weights`;
the stages do not change.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Protocol

import pyarrow as pa

from components.distributed import full_state_dict, is_writer
from components.precision import save_compute_copy
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
            with atomic_directory(self.layout.fs, path) as local:  # the masters cast to the compute dtype
                save_compute_copy(model, local, state, compute_dtype)
            # Older copies are not read again (with one_step_ahead the rollout is one copy behind).
            prune_weights(self.layout, version, self.keep_weights)
        return path

    def sync_weights(self, engine, version: int) -> dict[str, float]:
        # The newest committed copy at or before `version` (a resumed run may hold newer ones already).
        for candidate in range(version, -1, -1):
            path = self.layout.weights_dir("actor", candidate)
            if self.layout.fs.exists(f"{path}/{COMMITTED_MARKER}"):
                if engine.weights_version == candidate:
                    return {}
                started = time.perf_counter()
                engine.load_weights(path)
                engine.weights_version = candidate
                return {"timing_s/weight_sync": time.perf_counter() - started}
        return {}


def transport_for(config: Config) -> Transport:
    """The run's transport (storage is the only one today)."""
    return StorageTransport(layout_for(config), config.trainer.keep_weights)
