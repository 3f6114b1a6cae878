"""Supervised warm-start: a short next-token fine-tune on (prompt, target) pairs before RL.

RL from a randomly initialised model gets no reward signal (it never emits a correct answer), so
the quickstart first teaches the output format on the training split (loss on target tokens only,
an end-of-sequence token after each target), then hands over to RL. Validation prompts are never
used. This is the standard SFT-then-RL recipe, shortened.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from pydantic import Field

from components.algorithms import logprobs_from_logits, masked_mean
from components.batch import build_sequence_batch, response_logits
from components.settings import Section
from components.tools import DEFAULT_TOOL_RESPONSE_TEMPLATE


def target_tokens(tokenizer, target: str | Sequence[dict],
                  tool_response_template: str = DEFAULT_TOOL_RESPONSE_TEMPLATE) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one warm-start target, end-of-sequence last. A text is trained on throughout; a
    demonstration (assistant and tool messages, components.data) is laid out as a multi-turn rollout lays out its
    response (components/multi_turn.py): each message tokenized alone, a tool's answer through
    `tool_response_template` with mask 0 (the model reads it, as it will read the tool, but is not taught to
    write it)."""
    segments = [(target, 1)] if isinstance(target, str) else [
        (m["content"], 1) if m["role"] == "assistant" else (tool_response_template.format(result=m["content"]), 0)
        for m in target]
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in segments:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += tokens
        mask += [trained] * len(tokens)
    return ids + [tokenizer.eos_token_id], mask + [1]


def warm_start(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    target_texts: Sequence[str | Sequence[dict]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    resume: dict | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[int, dict], None] | None = None,
    tool_response_template: str = DEFAULT_TOOL_RESPONSE_TEMPLATE,
) -> list[float]:
    """Fine-tune `model` in place for `steps` AdamW steps; return the loss of each step. `on_step(step, loss)`
    is called after each step (1-based), e.g. to report progress. A target is a text or a multi-turn
    demonstration (`target_tokens`: the tools' answers are read, not trained on).

    Every `checkpoint_every` steps (before the last) `on_checkpoint(step, state)` gets what continuing needs
    besides the weights: the AdamW state, the data order's generator, torch's RNG and the losses so far.
    `resume` (such a state, with `model` holding the weights saved beside it) continues from its step, and
    ends with exactly the weights of a run that was never stopped."""
    device = next(model.parameters()).device
    targets, masks = zip(*[target_tokens(tokenizer, target, tool_response_template) for target in target_texts])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        generator.set_state(resume["generator"])
        torch.set_rng_state(resume["torch_rng"])
        losses = [float(loss) for loss in resume["losses"]]
    model.train()
    while len(losses) < steps:
        rows = torch.randint(len(targets), (batch_size,), generator=generator).tolist()
        batch = build_sequence_batch([prompt_ids[r] for r in rows], [targets[r] for r in rows],
                                     tokenizer.pad_token_id, loss_masks=[masks[r] for r in rows]).to(device)
        logprobs = logprobs_from_logits(response_logits(model, batch), batch.response_ids)
        loss = -masked_mean(logprobs, batch.response_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(len(losses), losses[-1])
        if on_checkpoint is not None and checkpoint_every and len(losses) % checkpoint_every == 0 and len(losses) < steps:
            on_checkpoint(len(losses), {"optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                                        "torch_rng": torch.get_rng_state(), "losses": list(losses)})
    model.eval()
    return losses


# The run's `warm_start` section (flows/config.py composes it).
class WarmStartConfig(Section):
    steps: int = Field(0, ge=0)
    """Supervised fine-tuning steps on training prompts + ground truth before RL (0: none)."""
    batch_size: int = Field(32, gt=0)
    """Examples per warm-start step."""
    lr: float = Field(1e-3, gt=0)
    """Warm-start learning rate."""
    checkpoint_every: int = Field(100, ge=0)
    """Save the warm-start's state (weights, AdamW, data order) every N of its steps (0: never): a run stopped
    during the warm-start continues it from there on resume instead of starting it over."""
    target: str = "auto"
    """What the warm-start trains toward: auto (a row's extra_info.answer, verl's GSM8K worked answer ending in
    `#### n`, else the ground truth), ground_truth, or extra_info.<key>."""
