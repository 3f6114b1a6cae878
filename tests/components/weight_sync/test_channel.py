"""components.weight_sync.channel: a key is polled with pauses that grow to the cap asked for before every pause
(so that a stage that starts waiting for a pull makes the sender's thread answer within milliseconds)."""

from __future__ import annotations

import time

import pytest

from components.weight_sync import channel


class _SetAfter:
    """A store whose key is set after `checks` checks of it."""

    def __init__(self, checks: int):
        self.checks, self.after = 0, checks

    def check(self, keys) -> bool:
        self.checks += 1
        return self.checks > self.after

    def get(self, key) -> bytes:
        return b"there"


def test_poll_pauses_grow_to_the_cap_it_asks_for_before_every_pause(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(channel.time, "sleep", pauses.append)
    assert channel.poll(_SetAfter(12), "k", time.monotonic() + 60) == b"there"
    assert pauses == pytest.approx([min(0.001 * 1.5 ** i, channel.IDLE_POLL_S) for i in range(12)])
    # the cap changes while it waits (a stage started waiting for a pull): the next pauses follow at once
    pauses.clear()
    caps = iter([channel.IDLE_POLL_S] * 10 + [channel.STREAM_POLL_S] * 5)
    channel.poll(_SetAfter(15), "k", time.monotonic() + 60, max_pause=lambda: next(caps))
    assert pauses[9] > 0.03 and pauses[10:] == [channel.STREAM_POLL_S] * 5
