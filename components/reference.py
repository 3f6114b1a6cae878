"""The reference policy: a frozen copy of the initial policy, for the KL term; with LoRA the actor's own model
with its adapter disabled (`AdapterReference`)."""

from __future__ import annotations

import torch

from components.actor import sequence_logprobs
from components.batch import SequenceBatch
from components.models import load_causal_lm


class Reference:
    def __init__(self, model, *, temperature: float = 1.0, micro_batch_size: int = 64, fused: bool = True):
        self.model = model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.fused = fused

    @classmethod
    def from_pretrained(cls, path: str, *, dtype="float32", device="auto", attn_implementation="auto",
                        trust_remote_code=False, temperature=1.0, micro_batch_size=64, fused=True):
        model = load_causal_lm(path, dtype=dtype, device=device, attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code)
        return cls(model, temperature=temperature, micro_batch_size=micro_batch_size, fused=fused)

    def compute_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """Log-probs `[B, T]` of the response tokens under the frozen model."""
        logprobs, _ = sequence_logprobs(self.model, batch, temperature=self.temperature,
                                        micro_batch_size=self.micro_batch_size, fused=self.fused)
        return logprobs


class AdapterReference:
    """The reference policy of a LoRA run: the actor's own model with its adapter disabled (no second copy).

    `actor` is a callable returning the resident actor (it may be rebuilt between steps); the actor's lock keeps
    its other passes off the model while the adapter is disabled (stages run concurrently on threads)."""

    def __init__(self, actor, *, micro_batch_size: int = 64):
        self._actor = actor
        self.micro_batch_size = micro_batch_size

    def compute_logprobs(self, batch) -> torch.Tensor:
        actor = self._actor()
        with actor.lock, actor.model.disable_adapter():
            logprobs, _ = sequence_logprobs(actor.model, batch, temperature=actor.temperature,
                                            micro_batch_size=self.micro_batch_size, fused=actor.fused)
        return logprobs

