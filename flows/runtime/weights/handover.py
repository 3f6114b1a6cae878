"""The driver's side of the weight hand-over: the pairing of each stage that samples with the policy and the
actor's stage that sends it, arranged from the stages' declarations (flows/training/registry.py), so that the
training flow only says which stage runs with which policy version.

- A stage declared `needs_policy_weights` takes the step, then optionally the policy version it samples with
  (default: the step) and, last, `sync`: the name of its hand-over, when the actor's worker streams that
  version (`Transport.streams`). Then the driver starts the stage declared `sends_policy_weights` on the
  actor's worker beside it: `sender(config, version, sync, for_stage, for_step)`.
- Before a stage that changes the policy's weights (its output is `weights/actor`) is started, every sender
  the run started is waited for: the actor's weights stay as they are until each version it was sending
  has arrived. The senders' metrics are its metrics too (after its own, as a step's metrics).
- A run that ends tells the senders still waiting to stop (`abandon`).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

from flows.config import Config
from flows.runtime.weights.transport import transport_for

POLICY_WEIGHTS = "weights/actor"
"""The output of a stage that changes the policy's weights."""


def needs_policy_weights(stage) -> bool:
    return bool(getattr(stage, "needs_policy_weights", False))


def changes_policy_weights(stage) -> bool:
    return getattr(stage, "output", None) == POLICY_WEIGHTS


def policy_version(args: tuple) -> int:
    """The policy version a stage declared `needs_policy_weights` samples with, from its arguments."""
    return args[1] if len(args) > 1 else args[0]


class HandOvers:
    """The streamed hand-overs of one run: the actor's sender stages still running beside the stages they feed.

    `submit(stage, *args)` and `wait(pending)` are the driver's (flows/runtime/driver.py: RunState); a pending
    stage has `metrics` (not None when a resumed run found it finished)."""

    def __init__(self, config: Config, submit: Callable[..., Any], wait: Callable[[Any], dict[str, float]]):
        self.config, self._submit, self._wait = config, submit, wait
        self.senders: list[tuple[str, Any]] = []
        """(sync, pending sender stage), in the order they were started."""

    def submit(self, stage, *args):
        """Start `stage`, needing the policy's weights, and the actor's sender of them beside it if streamed."""
        step, version = args[0], policy_version(args)
        if not transport_for(self.config).streams(version):
            return self._submit(stage, *args)
        sync = f"{stage.name}-{step}-{uuid.uuid4().hex[:8]}"
        pending = self._submit(stage, *args, sync)
        if pending.metrics is None:  # not finished already (a resumed run)
            self.senders.append((sync, self._submit(stage.weights_sender, version, sync, stage.name, step)))
        return pending

    def wait(self) -> dict[str, float]:
        """Wait for every sender the run started (before the actor's weights change again); their metrics."""
        metrics: dict[str, float] = {}
        while self.senders:
            _sync, pending = self.senders.pop(0)
            metrics |= self._wait(pending)
        return metrics

    def abandon(self) -> None:
        """The run ends: a sender still waiting for its stage's pull is told to stop (best effort)."""
        transport = transport_for(self.config)
        for sync, _pending in self.senders:
            transport.abandon(sync)
        self.senders.clear()
