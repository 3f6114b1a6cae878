"""How the actor's weights move to the rollout: one small interface, several implementations.

Stages never touch weight files directly: they publish or receive the actor's weights through a `Transport`.
A step's batches go their own way (flows/runtime/batches.py). Weights go one of two ways (`trainer.weight_sync`,
`weight_sync_mode`):

- `StorageTransport`: every published policy is a safetensors folder `weights/actor/<k>` committed
  atomically, which the rollout engine reads back (any process, any host).
- `MemoryTransport` (the rollout engine lives in the actor's process: `trainer.execution=local`): the
  engine gets the actor's live weights in memory, streamed in compute-dtype buckets (over CUDA IPC to
  vLLM's workers on a GPU; components/weight_sync/buckets.py); a stored copy is written, in the background, only of
  the versions recovery and export read back: checkpoint steps, the last step (every step with
  `trainer.keep_weights=null`). A resumed run reloads the rollout from the checkpoint step's copy,
  bit for bit what the memory path had given it. The copy's snapshot waits until the version was handed
  to the rollout (flows/runtime/stored_copy.py).
- `StreamTransport` (`trainer.execution=workers`): the same, between the actor's worker and the rollout's
  (components/weight_sync/sender.py). The rollout's stage pulls the version it needs through the actor's channel
  (`weights/actor/channel.json`): CUDA IPC where it sees the actor's GPU, else NCCL (gloo on CPUs). An
  unsharded actor answers from a thread as soon as it has published; the driver runs the actor's
  `send_weights` beside each such stage (`streams`), which holds the actor still until the pull is done and,
  for a sharded actor, gathers and sends on every rank. A version that cannot be streamed (the actor's worker
  was replaced) is read from its stored copy, or the stage fails saying to resume. A copy being written in
  another process (`weights/actor/<k>.writer.json` names it, from its publish to its commit) is waited for
  only while that process lives.
"""

from __future__ import annotations

import time
from typing import Protocol

from components.distributed import broadcast_call, full_state_dict, is_distributed, is_writer
from components.precision import save_compute_copy
from components.protocols import RolloutRole
from components.weight_sync.buckets import compute_tensors
from components.weight_sync.channel import Channel, StreamError
from components.weight_sync.receiver import LOAD_PARTS, RemoteWeights, WeightsUnavailable, abort
from components.weight_sync.sender import WeightSender
from components.weight_sync.trace import trace
from components.weight_sync.versions import InMemoryWeights, copy_files, write_copy
from flows.config import Config, layout_for
from flows.runtime.recovery import prune_weights
from flows.runtime.stored_copy import claim, copy_due, release, start_copy, writer_gone
from storage import COMMITTED_MARKER, RunLayout, atomic_directory, write_bytes_atomic

STORED_COPY_WAIT_S = 300.0
"""How long a reader waits for a stored copy that another process is still writing in the background."""
ACK_TIMEOUT_S = 120.0
"""How long a sender waits for the rollout to take one bucket (a replaced receiver pulls again sooner)."""


class Transport(Protocol):
    def publish_weights(self, model, version: int, compute_dtype) -> str:
        """Hand on the actor's weights as policy `version` (a collective when the actor is sharded)."""

    def sync_weights(self, engine: RolloutRole, version: int, sync: str | None = None) -> dict[str, float]:
        """Give `engine` the newest published policy at or before `version`, unless it holds it already
        (`sync`: the driver's name for this hand-over, when the actor's worker streams it: `streams`)."""

    def streams(self, version: int) -> bool:
        """Whether the actor's worker must send `version` (its `send_weights` stage) while the rollout syncs."""

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
        """Where the writer of the stored copy of `version` claims it (flows/runtime/stored_copy.py: claim)."""
        return f"{self.layout.run_dir}/weights/actor/{version}.writer.json"

    def sync_weights(self, engine: RolloutRole, version: int, sync: str | None = None) -> dict[str, float]:
        # The newest committed copy at or before `version` (a resumed run may hold newer ones already).
        for candidate in range(version, -1, -1):
            path = self.layout.weights_dir("actor", candidate)
            if self.layout.fs.exists(f"{path}/{COMMITTED_MARKER}"):
                return _load_into(engine, path, candidate)
        return {}


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
        # Off the step's critical path, after the hand-over (flows/runtime/stored_copy.py): the snapshot in the
        # compute dtype on the host (the model stays as it is until withdraw_weights, which waits for it), then
        # the writing and the atomic commit. A reader in another process waits for it while this process lives.
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
        metrics = _load_into(engine, published, version)
        self.handed_over(version)
        return metrics

    def _stored_exactly(self, engine: RolloutRole, version: int, why: str = "it is not in this process's memory") -> dict:
        """The stored copy of exactly `version` (a resumed run, a stream that failed; an older copy would be
        silently wrong); the initial policy (version 0) is the engine's own or weights/actor/0."""
        if version == 0:
            return StorageTransport.sync_weights(self, engine, 0)
        if engine.weights_version == version and not _needs_reload(engine):
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
        return _load_into(engine, folder, version)


_SENDER: WeightSender | None = None
"""This process's side of streamed hand-overs (the actor's worker, rank 0 hosts the channel)."""


def _sender() -> WeightSender:
    global _SENDER
    if _SENDER is None:
        _SENDER = WeightSender()
    return _SENDER


class StreamTransport(MemoryTransport):
    """Weights streamed from the actor's worker to the rollout's (trainer.execution=workers; see the module);
    stored copies as MemoryTransport's (a sharded actor writes them as StorageTransport does, in the stage)."""

    def __init__(self, layout: RunLayout, keep_weights: int | None, stored, *, timeout_s: float,
                 bucket_bytes: int, checkpoint_every: int = 1, connect_timeout_s: float = 300.0):
        super().__init__(layout, keep_weights, stored, checkpoint_every=checkpoint_every)
        self.timeout_s, self.bucket_bytes, self.connect_timeout_s = timeout_s, bucket_bytes, connect_timeout_s

    @property
    def channel_path(self) -> str:
        return f"{self.layout.run_dir}/weights/actor/channel.json"

    def streams(self, version: int) -> bool:
        return version > 0

    def publish_weights(self, model, version: int, compute_dtype) -> str:
        if is_writer():  # the rollout's worker finds the actor's channel from its first publish on
            self._write_channel(_sender().open())
        if is_distributed():  # the copy of a sharded model is a collective: in the stage, and only when due
            if self.stored(version):
                return StorageTransport.publish_weights(self, model, version, compute_dtype)
            return f"memory://{self.layout.weights_dir('actor', version)}"
        # Unsharded, a thread of this process answers pulls of the version as soon as it is published.
        _sender().publish(version, model, compute_dtype, self.bucket_bytes, ACK_TIMEOUT_S)
        return super().publish_weights(model, version, compute_dtype)

    def withdraw_weights(self) -> None:
        if not is_distributed():
            _sender().withdraw()  # a stream under way ends first
        super().withdraw_weights()

    def send_weights(self, model, version: int, compute_dtype, sync: str, holds: bool,
                     finished=lambda: False) -> dict[str, float]:
        sender = _sender()
        if is_writer():
            self._write_channel(sender.open())
        if not is_distributed():
            # The thread serves; this stage holds the actor still until the pull of `sync` is done. A replaced
            # worker that holds the version (restored from its checkpoint) serves it from now on.
            if holds and sender.serving != version:
                sender.publish(version, model, compute_dtype, self.bucket_bytes, ACK_TIMEOUT_S)
            sender.start_thread()
            metrics = sender.wait_done(sync, self.timeout_s, finished)
            self.handed_over(version)
            return metrics
        return sender.serve(
            sync=sync, version=version, holds=holds, tensors=lambda: compute_tensors(model, compute_dtype),
            device=next(model.parameters()).device, bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s,
            ack_timeout_s=ACK_TIMEOUT_S, writer=is_writer(), decide=broadcast_call, finished=finished)

    def _write_channel(self, channel: Channel) -> None:
        if self._read_channel() != channel:
            write_bytes_atomic(self.layout.fs, self.channel_path, channel.to_json().encode())

    def _read_channel(self) -> Channel | None:
        try:
            return Channel.from_json(self.layout.fs.cat_file(self.channel_path).decode())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def sync_weights(self, engine: RolloutRole, version: int, sync: str | None = None) -> dict[str, float]:
        if sync is None or not self.streams(version):
            return self._stored_exactly(engine, version, why="no stream was arranged for it")
        remote = RemoteWeights(self._read_channel, sync=sync, version=version, timeout_s=self.timeout_s,
                               bucket_timeout_s=ACK_TIMEOUT_S, connect_timeout_s=self.connect_timeout_s)
        try:
            if engine.weights_version == version and not _needs_reload(engine):
                return {}
            started = time.perf_counter()
            trace("sync.start", version=version)
            try:
                engine.load_weights(remote)
            except (WeightsUnavailable, StreamError, TimeoutError) as error:
                remote.finish()  # the sender's stage ends now: a stored copy due on its side is made at once
                print(f"policy version {version} was not streamed from the actor's worker ({error}); "
                      "reading its stored copy", flush=True)
                return {**self._stored_exactly(engine, version, why=str(error)), "weights/stream_fallback": 1.0}
            engine.weights_version = version
            # the parts of it: the wait for the sender's answer, the engine's wake and load (vLLM)
            parts = {name: value for name, value in engine.last_metrics.items()
                     if name in ("timing_s/wake", "timing_s/weight_load", *LOAD_PARTS)}
            trace("sync.end", version=version)
            return {"timing_s/weight_sync": time.perf_counter() - started, "timing_s/weight_wait": remote.waited_s,
                    **parts}
        finally:
            remote.finish()

    def abandon(self, sync: str) -> None:
        abort(self._read_channel(), sync)


def _needs_reload(engine: RolloutRole) -> bool:
    """A sleeping engine whose weights were streamed (not stored) lost them: they must come again."""
    return engine.asleep and engine.weights_path is None


def _load_into(engine: RolloutRole, source, version: int) -> dict[str, float]:
    """Give `engine` policy `version` from `source` (a stored folder or the live model), unless it holds it."""
    if engine.weights_version == version:
        return {}
    started = time.perf_counter()
    engine.load_weights(source)
    engine.weights_version = version
    return {"timing_s/weight_sync": time.perf_counter() - started}


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
