"""Weights as files of the run folder: every published policy is a safetensors folder `weights/actor/<k>`,
committed atomically, which the rollout engine reads back (any process, any host). The other transports keep
their stored copies here too, and read them back through `committed_copy`.
"""

from __future__ import annotations

import time

from components.distributed import full_state_dict, is_writer
from components.precision import save_compute_copy
from components.protocols import RolloutRole
from flows.runtime.recovery import prune_weights
from flows.runtime.weights.stored_copy import writer_gone
from storage import COMMITTED_MARKER, RunLayout, atomic_directory

STORED_COPY_WAIT_S = 300.0
"""How long a reader waits for a stored copy that another process is still writing in the background."""


class StorageTransport:
    """Weights as files of the run folder (shared storage between processes and hosts)."""

    def __init__(self, layout: RunLayout, keep_weights: int | None = None):
        self.layout, self.keep_weights = layout, keep_weights

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

    def streams(self, version: int) -> bool:
        return False

    def send_weights(self, model, version: int, compute_dtype, sync: str, holds: bool,
                     finished=lambda: False) -> dict[str, float]:
        return {}

    def abandon(self, sync: str) -> None:
        pass

    def committed_copy(self, version: int, timeout_s: float = STORED_COPY_WAIT_S) -> str:
        self.flush()  # this process's own copy, if it is still being written
        folder = self.layout.weights_dir("actor", version)
        started = time.monotonic()
        while not self.layout.fs.exists(f"{folder}/{COMMITTED_MARKER}"):
            waited_s = time.monotonic() - started
            gone = writer_gone(self.layout.fs, self.writer_path(version), waited_s)
            if gone and not self.layout.fs.exists(f"{folder}/{COMMITTED_MARKER}"):  # committed meanwhile: taken
                raise RuntimeError(f"policy version {version} has no stored copy under {folder}, and {gone}")
            if gone is None and waited_s > timeout_s:
                raise RuntimeError(f"policy version {version} has no stored copy under {folder}")
            time.sleep(0.2)
        return folder

    def writer_path(self, version: int) -> str:
        """Where the writer of the stored copy of `version` claims it (flows/runtime/weights/stored_copy.py)."""
        return f"{self.layout.run_dir}/weights/actor/{version}.writer.json"

    def sync_weights(self, engine: RolloutRole, version: int, sync: str | None = None) -> dict[str, float]:
        # The newest committed copy at or before `version` (a resumed run may hold newer ones already).
        for candidate in range(version, -1, -1):
            path = self.layout.weights_dir("actor", candidate)
            if self.layout.fs.exists(f"{path}/{COMMITTED_MARKER}"):
                return load_into(engine, path, candidate)
        return {}


def load_into(engine: RolloutRole, source, version: int) -> dict[str, float]:
    """Give `engine` policy `version` from `source` (a stored folder or the live model), unless it holds it."""
    if engine.weights_version == version:
        return {}
    started = time.perf_counter()
    engine.load_weights(source)
    engine.weights_version = version
    return {"timing_s/weight_sync": time.perf_counter() - started}
