"""Token batches for the models: left-padded prompts followed by right-padded responses.

Shapes: B sequences, P prompt tokens (longest prompt), T response tokens (longest response).
Keeping the prompt/response boundary at one column P for the whole batch makes the response slice
of every per-token tensor the same `[:, P:]` for every role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from storage import padded_tensor


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T], 1 for real tokens
    position_ids: torch.Tensor  # [B, P+T]
    response_mask: torch.Tensor  # [B, T] float, 1 for real response tokens the policy generated (trained on)
    prompt_length: int  # P

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_ids(self) -> torch.Tensor:  # [B, T]
        return self.input_ids[:, self.prompt_length :]

    @property
    def response_tokens(self) -> torch.Tensor:  # [B, T] float
        """1 for every real response token, a tool's included (response_mask leaves those out): per-token
        columns of the stage files hold a value for each of these."""
        return self.attention_mask[:, self.prompt_length :].float()

    def select(self, indices: torch.Tensor | slice) -> "SequenceBatch":
        return SequenceBatch(
            input_ids=self.input_ids[indices],
            attention_mask=self.attention_mask[indices],
            position_ids=self.position_ids[indices],
            response_mask=self.response_mask[indices],
            prompt_length=self.prompt_length,
        )

    def narrow(self, drop_prompt: int, width: int) -> "SequenceBatch":
        """The batch without its first `drop_prompt` columns (left padding of every row) and with only the
        first `width` response columns (the rest right padding of every row): same model outputs on the
        remaining tokens, less work. Per-token tensors `[B, T]` of the batch narrow to `[:, :width]`."""
        return SequenceBatch(
            input_ids=self.input_ids[:, drop_prompt : self.prompt_length + width],
            attention_mask=self.attention_mask[:, drop_prompt : self.prompt_length + width],
            position_ids=self.position_ids[:, drop_prompt : self.prompt_length + width],
            response_mask=self.response_mask[:, :width],
            prompt_length=self.prompt_length - drop_prompt,
        )

    def to(self, device: torch.device | str) -> "SequenceBatch":
        return SequenceBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
            prompt_length=self.prompt_length,
        )


ALIGNED = 8
"""On CUDA every cut micro-batch is a multiple of this many tokens long (where the batch has the columns): the
bf16 matmuls' tile width, and one kind of shape for model.compile's blocks, which otherwise compile again for the
first length that is not a multiple of 8 (the guard `(length % 8) == 0` the compiler adds for aligned memory)."""


class PaddingPlan:
    """Per-row padding of a batch, kept on the host, to cut each micro-batch to its own longest row.

    `bounds(rows)` gives (left-padding columns every row of `rows` has, response columns up to the last
    real token of any row) without touching the GPU; `lengths` (real tokens per row) lets the update
    group rows of similar length into the same micro-batches. `multiple` (ALIGNED on CUDA): each cut's length a
    multiple of it where the batch has the columns, by keeping left padding first, then by response columns.
    """

    def __init__(self, batch: SequenceBatch, multiple: int = 1):
        self.prompt_length, self.response_columns, self.multiple = batch.prompt_length, batch.response_length, multiple
        prompt_mask = batch.attention_mask[:, : batch.prompt_length].cpu()
        self.left_padding = (prompt_mask == 0).long().cumprod(dim=1).sum(dim=1)  # [B]
        response_mask = batch.response_tokens.cpu() > 0
        columns = torch.arange(1, response_mask.shape[1] + 1)
        self.response_extent = (response_mask * columns).max(dim=1).values if response_mask.numel() else \
            torch.zeros(batch.size, dtype=torch.long)  # [B]: 1 + index of the last real response token
        self.lengths = batch.prompt_length - self.left_padding + self.response_extent

    def bounds(self, rows: torch.Tensor | slice) -> tuple[int, int]:
        # One prompt column stays: the position before the first response token predicts it.
        drop = min(int(self.left_padding[rows].min()), max(self.prompt_length - 1, 0))
        width = max(1, int(self.response_extent[rows].max()))
        short = -(self.prompt_length - drop + width) % self.multiple  # columns to the next multiple
        kept = min(short, drop)  # of left padding, which costs no LM-head work
        return drop - kept, min(width + short - kept, self.response_columns)

    def cut(self, batch: SequenceBatch, rows: torch.Tensor | slice,
            device_rows: torch.Tensor | None = None) -> tuple[SequenceBatch, int]:
        """Those rows of `batch` cut to their longest row, and the response columns kept (`width`).

        `rows` (host) give the bounds; `device_rows`, the same rows on `batch`'s device, select them."""
        drop, width = self.bounds(rows)
        return batch.select(rows if device_rows is None else device_rows).narrow(drop, width), width


def aligned(device: torch.device) -> int:
    """The multiple the cut micro-batches' lengths are padded to on `device` (PaddingPlan's `multiple`)."""
    return ALIGNED if device.type == "cuda" else 1


def micro_batches(batch: SequenceBatch, micro_batch_size: int, multiple: int = 1) -> Iterator[SequenceBatch]:
    """Consecutive micro-batches of `batch`, each cut to its longest row (the no-grad passes)."""
    plan = PaddingPlan(batch, multiple)
    for start in range(0, batch.size, micro_batch_size):
        yield plan.cut(batch, slice(start, start + micro_batch_size))[0]


def pad_responses(values: torch.Tensor, length: int) -> torch.Tensor:
    """Per-token values `[B, width]` of a cut micro-batch back to the batch's `length` columns (0 after)."""
    return torch.nn.functional.pad(values, (0, length - values.shape[1]))


def build_sequence_batch(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_token_id: int,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> SequenceBatch:
    """Join prompts (left-padded to P) and responses (right-padded to T) into one batch.

    `loss_masks` (one 0/1 per response token; multi-turn rollouts: 0 on a tool's answer) leave tokens out of
    `response_mask`, so out of every loss and advantage; the model still attends to them."""
    prompts, prompt_mask = padded_tensor(prompt_ids, pad_token_id, torch.long, side="left")
    responses, response_tokens = padded_tensor(response_ids, pad_token_id, torch.long, side="right")
    if responses.shape[1] == 0:  # every response empty: keep one masked column so shapes stay valid
        responses = torch.full((len(response_ids), 1), pad_token_id, dtype=torch.long)
        response_tokens = torch.zeros(len(response_ids), 1)
    response_mask = response_tokens
    if loss_masks is not None:
        trained, given = padded_tensor(loss_masks, 0, torch.float32, side="right", length=responses.shape[1])
        if not torch.equal(given, response_tokens):
            raise ValueError("build_sequence_batch: a loss mask's length differs from its response's")
        response_mask = response_tokens * trained
    attention_mask = torch.cat([prompt_mask, response_tokens], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return SequenceBatch(
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask.float(),
        prompt_length=prompts.shape[1],
    )


def model_logits(model, batch: SequenceBatch) -> torch.Tensor:
    """The model's logits at the last T+1 positions, `[B, T+1, V]` in the model's dtype.

    Position P-1+t predicts response token t (index t here); the last one predicts nothing. Only these
    positions go through the LM head.
    """
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=batch.response_length + 1,
    )
    return output.logits


def response_logits(model, batch: SequenceBatch, temperature: float = 1.0) -> torch.Tensor:
    """Float32 logits that predict each response token: `[B, T, V]`, divided by the sampling temperature."""
    logits = model_logits(model, batch)[:, :-1, :].float()
    return logits / temperature if temperature != 1.0 else logits
