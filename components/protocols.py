"""What each role must provide, as Protocols: roles compose these, they do not inherit.

A new backend (an FSDP actor, a vLLM rollout engine, a remote reward service) implements the same
methods and the stages in flows/training/stages.py use it unchanged. Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from components.batch import SequenceBatch
from components.rollout import Generation, SamplingParams


@runtime_checkable
class RolloutRole(Protocol):
    """A rollout engine: everything the runtime uses on one (the stages, the weight transport, the residents).

    A new engine is a module with a class providing these members and one entry in
    `flows.training.engines.ROLLOUT_ENGINES` (its builder); the stages and the transport use it unchanged.
    Nothing here is probed with getattr: an engine that has no use for a member still provides it."""

    weights_version: int | None
    """The policy version the engine holds (set by the transport after `load_weights`; None: the initial
    model's, before any hand-over)."""

    last_metrics: dict[str, float]
    """Timings and counts of the engine's last call (`timing_s/weight_load`, `timing_s/wake`, ...; see
    components.weight_sync.receiver.LOAD_PARTS), merged into the stage's metrics; empty when it has none."""

    asleep: bool
    """Whether the engine has released its GPU memory (vLLM sleep mode) and must wake before it generates;
    an engine that never sleeps says False."""

    weights_path: str | None
    """The stored copy (a folder) the engine's current weights came from; None when they came from memory
    (then a sleeping engine has lost them, and the transport hands them over again)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """`n` samples per prompt, prompt-major, with the log-probs of the sampled tokens."""

    def load_weights(self, source) -> None:
        """Replace the weights in place from a safetensors folder (a path), from the actor's live model
        (components.weight_sync.versions.InMemoryWeights) or streamed from the actor's worker
        (components.weight_sync.receiver.RemoteWeights)."""

    def close(self) -> None:
        """Release what the engine holds beyond Python objects (processes, GPU memory); the residents call it
        when the run's roles are released. Idempotent."""


ROLLOUT_MEMBERS: tuple[str, ...] = (*RolloutRole.__annotations__,
                                    *(name for name, value in vars(RolloutRole).items()
                                      if callable(value) and not name.startswith("_")))
"""RolloutRole's members, in declaration order (Python 3.11 has no typing.get_protocol_members)."""


@runtime_checkable
class PolicyRole(Protocol):
    def compute_logprobs(self, batch: SequenceBatch, with_entropy: bool = False):
        """(log-probs `[B, T]`, entropies `[B, T]` or None) of the batch's responses."""

    def update(self, batch: SequenceBatch, *, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None,
               rollout_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One policy update; returns `actor/*` metrics (old_logprobs=None: on-policy, see Actor.update)."""


@runtime_checkable
class ReferenceRole(Protocol):
    def compute_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """Log-probs `[B, T]` under the frozen reference."""


@runtime_checkable
class ValueRole(Protocol):
    def compute_values(self, batch: SequenceBatch) -> torch.Tensor:
        """Values `[B, T]`."""

    def update(self, batch: SequenceBatch, *, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """One value update; returns `critic/*` metrics."""


@runtime_checkable
class RewardModelRole(Protocol):
    def score(self, prompt_texts: list[str], response_texts: list[str]) -> list[float]:
        """One scalar per (prompt, response)."""
