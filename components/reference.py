"""The reference policy: a frozen copy of the initial policy, for the KL term."""

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
