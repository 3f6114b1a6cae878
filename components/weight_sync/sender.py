"""Weights between processes: the actor's worker streams a policy version to the rollout's worker in the
compute-dtype buckets of buckets.py, with no copy on storage on the way (trainer.execution=workers).

Rendezvous. The sender (the actor's rank 0) hosts a TCPStore and says where it listens in a small JSON
`Channel` (address, port, a random token, its pid) that the transport writes to the run folder. The rest is
keys of that store, as JSON (nothing is unpickled):

- a queue of messages `req/<n>` (n from the store's counter `requests`): a receiver's pull
  {"kind": "pull", "sync", "version", "session", "device", "gpus", "loaders"}; {"kind": "done", "sync"} once
  the receiver of a sync has what it needs; {"kind": "abort", "sync"} when the driver gives the sync up.
  Every message carries the channel's token; the sender ignores one without it.
- the sender's answer to a pull, `reply/<n>`: {"status": "stream", "method", ...} or
  {"status": "unavailable", "holds": version or null} (its actor holds another version);
- bucket b of pull n: `<n>/bucket/<b>` = {"specs", "payload"} (for method collective the bytes follow as a
  broadcast from the sender to the loaders), the receiver's ack `<n>/ack/<b>`, and {"end": true} last.

Methods. `cuda_ipc`: every process that loads (vLLM's workers, or the transformers engine) sees the sender's
GPU: a bucket is a CUDA IPC handle of the sender's buffer, no copy through the host (the actor and the
rollout on one GPU). `collective`: a process group of the sender (rank 0) and the loaders (ranks 1..L) made
over the same store, NCCL when both sides compute on GPUs (other GPUs of the host, or other hosts that reach
the sender's address), gloo otherwise (CPUs: the CPU build in CI); made once per receiving engine and kept.

The rollout's side is receiver.py (`RemoteWeights`). A sharded actor: every rank calls
`WeightSender.serve`; rank 0 talks to the store and hands each decision
to the others (`decide`), so that all ranks gather the same parameters, one at a time, in the same order.

Failures. A receiver that goes silent mid-stream is given up after `ack_timeout_s`, or as soon as a newer
pull arrives (its replacement); a sender that dies makes the receiver's store calls fail, and the receiver
falls back to the stored copy (flows/runtime/weights/streamed.py). The store listens on the channel's address
only (`listen`: the loopback when every worker is on one host); its port, like NCCL's, is for a trusted
network: the token keeps stray clients out of the protocol, not an attacker who can read the run folder.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from components.weight_sync.buckets import BucketBuffers, PackPlan, compute_tensors, pack_buckets
from components.weight_sync.channel import (COLLECTIVE_KIND, IDLE_POLL_S, IPC_KIND, STREAM_POLL_S, Channel,
                                            StreamError, broadcast, encode_share, ipc_payload, listen, make_group,
                                            poll, seconds)
from components.weight_sync.trace import busy_threads, trace, tracing

SLOW_PACK_S = 0.03  # traced: a bucket that took longer to pack (7-23 ms at the 0.5B shape on one H200)


def _choose_method(pull: dict, device: torch.device) -> tuple[str, str | None]:
    """(method, collective backend) for a pull: CUDA IPC when every loader sees the sender's GPU."""
    if device.type == "cuda":
        sender_gpu = str(torch.cuda.get_device_properties(device).uuid)
        if pull.get("device") == "cuda" and sender_gpu in pull.get("gpus", []):
            return IPC_KIND, None
        if pull.get("device") == "cuda":
            return COLLECTIVE_KIND, "nccl"
    return COLLECTIVE_KIND, "gloo"


_OPEN_SENDERS: "weakref.WeakSet[WeightSender]" = weakref.WeakSet()


@atexit.register
def _close_senders() -> None:
    for sender in list(_OPEN_SENDERS):
        sender.close()


class WeightSender:
    """The actor's side: hosts the channel (rank 0) and answers pulls with its live weights (`serve`)."""

    def __init__(self, address: str | None = None):
        self.address = address
        self.store = None
        self.channel: Channel | None = None
        self.next_message = 1
        self.groups: dict[str, tuple[str, object, str]] = {}  # session -> (prefix, group, backend)
        self._made = 0
        self._buffers = BucketBuffers()  # the same IPC handle from one hand-over to the next
        self._lock = threading.Lock()
        self._current: _Published | None = None
        self._plan: PackPlan | None = None  # the last published model's buckets, kept from version to version
        self._thread: threading.Thread | None = None
        self._ended_changed = threading.Condition()
        self._ended: dict[str, str] = {}  # sync -> how it ended (done, abort), until its stage asks
        self._awaited = 0  # stages waiting in wait_done (see _pace)
        self._sent: dict[str, tuple[int, float]] = {}  # sync -> (streams, seconds sending)
        self._closed = threading.Event()
        _OPEN_SENDERS.add(self)

    def open(self) -> Channel:
        """Start the channel's store (once per process); returns where it listens."""
        if self.channel is None:
            address, fd = listen(self.address)
            self.store = torch.distributed.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                                                    timeout=seconds(60), master_listen_fd=fd)
            self.channel = Channel(host=socket.gethostname(), address=address, port=int(self.store.port),
                                   token=secrets.token_hex(16), pid=os.getpid())
        return self.channel

    def close(self) -> None:
        """Stop answering: the thread ends (within a second or so) before the store and the groups are let go. A
        thread still in a call of the store when the process ends aborted it ('terminate called without an
        active exception', exit code 134: half the runs of the streamed transport tests): every sender still
        open is closed at exit."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self.groups.clear()
        self.store, self.channel = None, None

    # -- an unsharded actor: a thread answers pulls as soon as a version is published -----------------

    def publish(self, version: int, model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int,
                ack_timeout_s: float) -> None:
        """Serve `version` of the live `model` (cast to `dtype`) from now on, until `withdraw`, on a thread of
        this process: a pull is answered at once, without waiting for a stage to be dispatched."""
        # Laid out here, on the thread that trained it, not on the serving thread (see PackPlan).
        tensors = list(compute_tensors(model, dtype, cast=False, detach=False))
        with self._lock:
            if self._plan is None or not self._plan.fits(tensors, bucket_bytes, dtype):
                self._plan = PackPlan(tensors, bucket_bytes, self._buffers, dtype)
            self._current = _Published(version, weakref.ref(model), self._plan, ack_timeout_s)
        trace("send.published", version=version)
        self.start_thread()

    def start_thread(self) -> None:
        """Answer pulls on a thread (what this process publishes, `unavailable` for anything else)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="rlhf-weights-server", daemon=True)
            self._thread.start()

    @property
    def serving(self) -> int | None:
        """The version the thread serves now (None: none)."""
        current = self._current
        return None if current is None else current.version

    def withdraw(self) -> None:
        """The actor is about to change: stop serving its version (a stream under way ends first)."""
        with self._lock:
            self._current = None

    def wait_done(self, sync: str, timeout_s: float, finished: Callable[[], bool] = lambda: False) -> dict:
        """The driver's stage for `sync`, when the thread serves: wait until its receiver is done (or aborted,
        `finished()`, `timeout_s`), so that the actor does not change under a pull still to come."""
        deadline = time.monotonic() + timeout_s
        trace("send.stage_waits", sync=sync)
        with self._ended_changed:
            self._awaited += 1
            try:
                while sync not in self._ended and not finished() and time.monotonic() < deadline:
                    self._ended_changed.wait(1.0)
            finally:
                self._awaited -= 1
            self._ended.pop(sync, None)
            streams, sending = self._sent.pop(sync, (0, 0.0))
        metrics = {"weights/streams": float(streams), "timing_s/send_weights": sending}
        if time.monotonic() >= deadline:
            metrics["weights/send_timeout"] = 1.0
        return metrics

    def _pace(self) -> float:
        """The thread's longest pause: short while a pull may come (a version is served, or a stage waits for
        one; a check of the store took 7 us on a 2-core machine like CI, so 500 a second are cheap), else IDLE_POLL_S."""
        return STREAM_POLL_S if self._current is not None or self._awaited else IDLE_POLL_S

    def _run(self) -> None:
        while self.store is not None and not self._closed.is_set():
            try:
                got = self._message(time.monotonic() + 60, self._closed.is_set, self._pace)
                if got is None:
                    continue
                number, message = got
                kind, sync = message.get("kind"), str(message.get("sync"))
                if kind in ("done", "abort"):
                    with self._ended_changed:
                        self._ended[sync] = kind
                        self._ended_changed.notify_all()
                elif kind == "pull":
                    self._serve_pull(number, message)
            except StreamError:
                return  # the store is gone (close)
            except Exception as error:  # noqa: BLE001 - one bad message must not end the serving
                if self.store is None:
                    return  # closed under it
                print(f"weights server: {error!r}", flush=True)

    def _serve_pull(self, number: int, pull: dict) -> None:
        trace("send.pull_seen", number=number)
        with self._lock:  # withdraw waits for the stream
            current = self._current
            model = None if current is None or not current.plan.available else current.model()
            if model is None or int(pull.get("version", -1)) != current.version:
                self._reply(number, {"status": "unavailable", "holds": None if model is None else current.version})
                return
            started = time.perf_counter()
            device = next(model.parameters()).device
            self._stream(self._answer(number, pull, device), current.plan.buckets(), current.ack_timeout_s)
            sync = str(pull.get("sync"))
            with self._ended_changed:
                streams, sending = self._sent.get(sync, (0, 0.0))
                self._sent[sync] = (streams + 1, sending + time.perf_counter() - started)

    def serve(self, *, sync: str, version: int, holds: bool, tensors: Callable[[], Iterator], device: torch.device,
              bucket_bytes: int, timeout_s: float, ack_timeout_s: float, writer: bool = True,
              decide: Callable[[dict | None], dict] = lambda plan: plan,
              finished: Callable[[], bool] = lambda: False) -> dict[str, float]:
        """Answer pulls of policy `version` (which this process's actor `holds`, or not) until the receiver of
        `sync` says it is done, the driver aborts it, `finished()` (checked every second: the stage the sync
        fed has committed its output, should its word have been lost) or `timeout_s` passes. Every rank of a
        sharded actor calls this; `writer` (rank 0) talks to the store, `decide` hands its decisions to the
        other ranks, and `tensors()` (a collective on a sharded model) is iterated by every rank per stream."""
        deadline = time.monotonic() + timeout_s
        metrics = {"weights/streams": 0.0, "timing_s/send_weights": 0.0}
        while True:
            plan = decide(self._next_pull(sync, version, holds, device, deadline, finished) if writer else None)
            if plan["do"] == "stop":
                if plan.get("why") == "timeout":
                    metrics["weights/send_timeout"] = 1.0
                return metrics
            started = time.perf_counter()
            if writer:
                self._stream(plan, pack_buckets(tensors(), bucket_bytes, self._buffers), ack_timeout_s)
            else:
                for _ in tensors():  # gather in lockstep with rank 0
                    pass
            metrics["timing_s/send_weights"] += time.perf_counter() - started
            metrics["weights/streams"] += 1

    # -- rank 0 ------------------------------------------------------------------------------

    def _message(self, deadline: float, finished: Callable[[], bool],
                 max_pause: Callable[[], float]) -> tuple[int, dict] | None:
        """The next message of the queue with the channel's token (None at the deadline or once `finished()`),
        polled with pauses up to `max_pause()`.
        A number taken from the counter whose message never came (its sender died in between) is skipped
        after a few seconds."""
        while True:
            number, waited_since = self.next_message, time.monotonic()
            checked = [waited_since]

            def check() -> None:
                now = time.monotonic()
                if now - checked[0] >= 1.0:
                    checked[0] = now
                    if finished():
                        raise _Finished()
                    if now - waited_since > 5 and int(self.store.add("requests", 0)) > number:
                        raise _Skip()

            try:
                raw = poll(self.store, f"req/{number}", deadline, check, max_pause)
            except (TimeoutError, _Finished):
                return None
            except _Skip:
                self.next_message += 1
                continue
            self.next_message += 1
            message = json.loads(raw)
            if message.get("token") == self.channel.token:
                return number, message

    def _next_pull(self, sync: str, version: int, holds: bool, device: torch.device, deadline: float,
                   finished: Callable[[], bool]) -> dict:
        """Read messages until a pull to stream ({"do": "stream"}) or the end of this sync ({"do": "stop"}).
        A pull of another sync for the same version is served too (a retried stage's), one of another version
        is answered `unavailable`."""
        while True:
            got = self._message(deadline, finished, lambda: STREAM_POLL_S)  # a stage waits for the pull
            if got is None:
                return {"do": "stop", "why": "timeout" if time.monotonic() > deadline else "finished"}
            number, message = got
            kind = message.get("kind")
            if kind in ("done", "abort"):
                if message.get("sync") == sync:
                    return {"do": "stop", "why": kind}
                continue
            if kind != "pull":
                continue
            if int(message.get("version", -1)) != version or not holds:
                self._reply(number, {"status": "unavailable", "holds": version if holds else None})
                continue
            return self._answer(number, message, device)

    def _answer(self, number: int, pull: dict, device: torch.device) -> dict:
        """Reply to a pull that will be streamed: how (CUDA IPC, or which group); returns the plan."""
        method, backend = _choose_method(pull, device)
        reply = {"status": "stream", "method": method}
        if method == COLLECTIVE_KIND:
            session = str(pull.get("session"))
            known = self.groups.get(session)
            if known is None or known[2] != backend:
                self._made += 1
                known = (f"rlhf-weights/{session}/{self._made}", None, backend)
                self.groups[session] = known
            reply.update(group=known[0], backend=backend, world=1 + int(pull.get("loaders", 1)),
                         join=known[1] is None, channel=asdict(self.channel))
        self._reply(number, reply)
        trace("send.reply_set", number=number, method=method)
        return {"do": "stream", "number": number, "pull": pull, **reply}

    def _reply(self, number: int, reply: dict) -> None:
        self.store.set(f"reply/{number}", json.dumps(reply))

    def _group(self, plan: dict, timeout_s: float):
        session = str(plan["pull"].get("session"))
        prefix, group, backend = self.groups[session]
        if group is None:
            try:
                group = make_group(self.channel, prefix, 0, plan["world"], backend, timeout_s, store=self.store)
            except RuntimeError as error:
                self.groups.pop(session, None)
                raise StreamError(f"the rollout's loaders did not join weights group {prefix}: {error}") from error
            self.groups[session] = (prefix, group, backend)
        return group

    def _stream(self, plan: dict, buckets: Iterator, ack_timeout_s: float) -> None:
        """Send every bucket of one pull. On a broken stream the rest is still iterated (the other ranks of a
        sharded actor gather in lockstep) but not sent; the receiver sees no `end` and falls back."""
        number, count, failed = plan["number"], 0, None
        try:
            group = self._group(plan, ack_timeout_s) if plan["method"] == COLLECTIVE_KIND else None
        except StreamError as error:
            group, failed = None, error
        packing, cpu = time.perf_counter(), time.thread_time()
        for bucket in buckets:
            if failed is not None:
                continue
            trace("send.packed", number=number, bucket=count)
            if tracing() and time.perf_counter() - packing > SLOW_PACK_S:
                # this thread's CPU time meanwhile (below the wall time: it waited), and what else runs now
                trace("send.pack_slow", number=number, bucket=count, ms=f"{(time.perf_counter() - packing) * 1e3:.1f}",
                      cpu_ms=f"{(time.thread_time() - cpu) * 1e3:.1f}", busy=busy_threads())
            try:
                self._send(number, count, bucket, plan, group, ack_timeout_s)
                count += 1
            except (StreamError, TimeoutError, RuntimeError) as error:
                failed = error
                if group is not None:  # a collective that failed leaves its group unusable
                    self.groups.pop(str(plan["pull"].get("session")), None)
            packing, cpu = time.perf_counter(), time.thread_time()
        if failed is None:
            self.store.set(f"{number}/bucket/{count}", json.dumps({"end": True, "count": count}))
            trace("send.end_set", number=number, buckets=count)
            return
        print(f"weights stream {number} of sync {plan['pull'].get('sync')} broke after {count} bucket(s): {failed}",
              flush=True)
        try:  # a receiver still listening learns it at once
            self.store.set(f"{number}/bucket/{count}", json.dumps({"broken": str(failed)}))
        except RuntimeError:
            pass

    def _send(self, number: int, index: int, bucket, plan: dict, group, ack_timeout_s: float) -> None:
        if plan["method"] == IPC_KIND:
            payload = ipc_payload(bucket.buffer, bucket.nbytes)
            payload["share"] = encode_share(tuple(payload["share"]))
        else:
            payload = {"kind": COLLECTIVE_KIND, "group": plan["group"], "backend": plan["backend"],
                       "nbytes": bucket.nbytes, "capacity": bucket.buffer.numel()}
        self.store.set(f"{number}/bucket/{index}", json.dumps({"specs": bucket.specs, "payload": payload}))
        trace("send.bucket_set", number=number, bucket=index)
        if group is not None:
            data = bucket.buffer[:bucket.nbytes]
            if plan["backend"] == "gloo" and data.is_cuda:
                data = data.cpu()
            broadcast(group, data)

        def replaced() -> None:  # a newer message: the receiver's replacement (a resubmitted stage) pulls again
            if self.store.check([f"req/{self.next_message}"]):
                raise StreamError("a newer message arrived while waiting for an ack")

        poll(self.store, f"{number}/ack/{index}", time.monotonic() + ack_timeout_s, replaced, lambda: STREAM_POLL_S)
        trace("send.ack_seen", number=number, bucket=index)


@dataclass
class _Published:
    version: int
    model: Callable[[], torch.nn.Module | None]  # a weak reference: a released actor is not kept alive
    plan: PackPlan  # its buckets (weak references too)
    ack_timeout_s: float


class _Skip(Exception):
    pass


class _Finished(Exception):
    pass
