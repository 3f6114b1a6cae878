"""Weights streamed from the actor's worker to the rollout's (trainer.execution=workers; the sender and the
receiver: components/weight_sync/). The rollout's stage pulls the version it needs through the actor's channel
(`weights/actor/channel.json`): CUDA IPC where it sees the actor's GPU, else NCCL (gloo on CPUs). An unsharded
actor answers from a thread as soon as it has published; the driver runs the actor's sender stage beside each
such stage (flows/runtime/weights/handover.py), which holds the actor still until the pull is done and, for a
sharded actor, gathers and sends on every rank. A version that cannot be streamed (the actor's worker was
replaced) is read from its stored copy, or the stage fails saying to resume. A copy being written in another
process (`weights/actor/<k>.writer.json` names it, from its publish to its commit) is waited for only while
that process lives.
"""

from __future__ import annotations

import time

from components.distributed import broadcast_call, is_distributed, is_writer
from components.protocols import RolloutRole
from components.weight_sync.buckets import compute_tensors
from components.weight_sync.channel import Channel, StreamError
from components.weight_sync.receiver import LOAD_PARTS, RemoteWeights, WeightsUnavailable, abort
from components.weight_sync.sender import WeightSender
from components.weight_sync.trace import trace
from flows.runtime.weights.in_memory import MemoryTransport, needs_reload
from flows.runtime.weights.on_storage import StorageTransport
from storage import RunLayout, write_bytes_atomic

ACK_TIMEOUT_S = 120.0
"""How long a sender waits for the rollout to take one bucket (a replaced receiver pulls again sooner)."""

_SENDER: WeightSender | None = None
"""This process's side of streamed hand-overs (the actor's worker, rank 0 hosts the channel)."""


def _sender() -> WeightSender:
    global _SENDER
    if _SENDER is None:
        _SENDER = WeightSender()
    return _SENDER


class StreamTransport(MemoryTransport):
    """Weights streamed from the actor's worker to the rollout's (see the module); stored copies as
    MemoryTransport's (a sharded actor writes them as StorageTransport does, in the stage)."""

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
            if engine.weights_version == version and not needs_reload(engine):
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
