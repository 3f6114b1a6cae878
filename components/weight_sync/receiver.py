"""The rollout's side of a weights stream (sender.py has the protocol and the actor's side): `RemoteWeights`,
a policy version pulled from the actor's worker into an engine that offers the `Loader` methods
(VLLMRolloutEngine, HFRolloutEngine); `abort`, the driver giving a hand-over up.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Protocol

from components.weight_sync.channel import COLLECTIVE_KIND, STREAM_POLL_S, Channel, StreamError, connect, poll
from components.weight_sync.trace import trace


class WeightsUnavailable(RuntimeError):
    """The sender's actor does not hold the version asked for (a replaced worker, a failed update)."""


LOAD_PARTS = ("timing_s/weight_receive", "timing_s/weight_apply", "weights/direct")
"""What an engine's `last_metrics` may say of its last in-memory load besides its whole (timing_s/weight_load):
opening the buckets, the loaders' copies, and whether they went straight into the live tensors (1) or not."""


class Loader(Protocol):
    """What a rollout engine offers to receive a streamed policy (VLLMRolloutEngine, HFRolloutEngine)."""

    weight_session: str
    """Names this engine to the sender (a collective group is made once per session)."""

    def describe_loaders(self) -> dict:
        """{"device": "cuda" | "cpu", "gpus": GPU uuids every loading process sees, "loaders": how many}."""

    def join_weight_group(self, channel: dict, prefix: str, first_rank: int, world: int, backend: str,
                          timeout_s: float) -> None:
        """Every loading process joins group `prefix` (ranks first_rank.., of `world`)."""

    def begin_load(self) -> None: ...

    def load_bucket(self, specs: list, payload: dict) -> None:
        """Load one bucket; done with it on return (the sender refills its buffer next)."""

    def finish_load(self) -> None: ...


class _Moved(Exception):
    pass


class RemoteWeights:
    """Policy `version`, held by the actor's worker and pulled through its channel: a source for an engine's
    `load_weights` (`receive_into`), then `finish()` tells the sender the sync `sync` is done."""

    def __init__(self, channel: Callable[[], Channel | None], *, sync: str, version: int, timeout_s: float,
                 bucket_timeout_s: float = 120.0, connect_timeout_s: float = 30.0):
        self._read_channel = channel
        self.sync, self.version = sync, version
        self.timeout_s, self.bucket_timeout_s, self.connect_timeout_s = timeout_s, bucket_timeout_s, connect_timeout_s
        self._store = None
        self._channel: Channel | None = None
        self.waited_s = 0.0
        """Seconds the last pull waited for the sender's answer (after the engine woke, when it was posted ahead)."""
        self._finished = False
        self._asked: int | None = None  # a pull posted ahead (`ask`), not yet read

    def _connected(self, timeout_s: float | None = None):
        """The store of the current channel, waiting up to `timeout_s` (connect_timeout_s) for one to appear
        and answer."""
        channel = self._read_channel()
        if self._store is not None and channel == self._channel:
            return self._store
        deadline = time.monotonic() + (self.connect_timeout_s if timeout_s is None else timeout_s)
        last_error: Exception | None = None
        while True:
            if channel is not None:
                try:
                    wait = min(5.0, max(0.5, deadline - time.monotonic()))
                    self._store, self._channel = connect(channel, timeout_s=wait), channel
                    return self._store
                except StreamError as error:
                    last_error = error
            if time.monotonic() > deadline:
                where = "no channel published" if channel is None else str(last_error)
                raise StreamError(f"the actor's worker has no reachable weights channel ({where})")
            time.sleep(0.5)
            channel = self._read_channel()

    def _post(self, message: dict, timeout_s: float | None = None) -> int:
        store = self._connected(timeout_s)
        number = int(store.add("requests", 1))
        store.set(f"req/{number}", json.dumps({**message, "token": self._channel.token, "sync": self.sync}))
        return number

    def ask(self, loader: Loader) -> None:
        """Post the pull now, ahead of `receive_into` (which reads its answer): the sender answers and packs its
        first bucket while the engine wakes. Raises StreamError, as `receive_into` would, when no channel answers."""
        if self._asked is None:
            self._asked = self._post_pull(loader)

    def _post_pull(self, loader: Loader) -> int:
        info = loader.describe_loaders()
        trace("recv.pull", sync=self.sync)
        return self._post({"kind": "pull", "version": self.version, "session": loader.weight_session, **info})

    def receive_into(self, loader: Loader, attempts: int = 3) -> int:
        """`_receive_once`, again on the new channel when the actor's worker was replaced meanwhile."""
        for attempt in range(attempts):
            try:
                return self._receive_once(loader)
            except _Moved:
                if attempt == attempts - 1:
                    raise StreamError("the actor's weights channel kept changing (its worker was replaced)") from None
        raise AssertionError("unreachable")

    def _receive_once(self, loader: Loader) -> int:
        """Pull the version into `loader`; returns how many buckets came. Raises WeightsUnavailable when the
        sender holds another version, StreamError or TimeoutError when the stream breaks. The answer may take up
        to `timeout_s` (the actor's worker finishes what it was doing first); each bucket `bucket_timeout_s`. The
        pull is the one posted by `ask`, if any."""
        number = self._asked if self._asked is not None else self._post_pull(loader)
        self._asked = None  # a retry (the channel moved) posts again
        store, channel = self._store, self._channel
        deadline = time.monotonic() + self.timeout_s

        checked = [time.monotonic()]

        def moved() -> None:  # the actor's worker was replaced: its channel is another one (read once a second)
            if time.monotonic() - checked[0] >= 1.0:
                checked[0] = time.monotonic()
                if self._read_channel() != channel:
                    raise _Moved()

        asked = time.perf_counter()
        trace("recv.pull_posted", number=number)
        reply = json.loads(poll(store, f"reply/{number}", deadline, moved))
        self.waited_s = time.perf_counter() - asked
        trace("recv.reply_got", number=number)
        if reply["status"] != "stream":
            raise WeightsUnavailable(f"the actor's worker holds policy version {reply.get('holds')}, "
                                     f"not {self.version}")
        if reply["method"] == COLLECTIVE_KIND and reply.get("join"):
            loader.join_weight_group(reply["channel"], reply["group"], 1, int(reply["world"]), reply["backend"],
                                     self.timeout_s)
        loader.begin_load()
        trace("recv.begun", number=number)
        index = 0
        while True:
            message = json.loads(poll(store, f"{number}/bucket/{index}", time.monotonic() + self.bucket_timeout_s,
                                       moved, lambda: STREAM_POLL_S))
            if message.get("end"):
                break
            if "broken" in message:
                raise StreamError(f"the actor's worker stopped the stream: {message['broken']}")
            trace("recv.bucket_seen", number=number, bucket=index)
            loader.load_bucket(message["specs"], message["payload"])
            store.set(f"{number}/ack/{index}", b"1")
            trace("recv.acked", number=number, bucket=index)
            index += 1
        trace("recv.end_seen", number=number)
        loader.finish_load()
        trace("recv.finished", number=number)
        return index

    def finish(self) -> None:
        """Tell the sender this sync needs nothing more (best effort: a sender not there yet sees the stage's
        output committed instead); once."""
        if self._finished:
            return
        self._finished = True
        try:
            self._post({"kind": "done"}, timeout_s=2.0)
        except (StreamError, RuntimeError):
            pass


def abort(channel: Channel | None, sync: str) -> None:
    """The driver gives sync `sync` up (its stage failed): a sender waiting for it returns (best effort)."""
    if channel is None:
        return
    try:
        store = connect(channel, timeout_s=5.0)
        number = int(store.add("requests", 1))
        store.set(f"req/{number}", json.dumps({"kind": "abort", "sync": sync, "token": channel.token}))
    except (StreamError, RuntimeError):
        pass


def new_session() -> str:
    return uuid.uuid4().hex[:12]
