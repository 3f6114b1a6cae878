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
    weights_version: int | None

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """`n` samples per prompt, prompt-major, with the log-probs of the sampled tokens."""

    def load_weights(self, source) -> None:
        """Replace the weights in place from a safetensors folder (a path) or from the actor's live model
        (components.weight_sync.versions.InMemoryWeights)."""


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
