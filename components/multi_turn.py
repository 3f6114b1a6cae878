"""Multi-turn rollouts: each sample is a conversation in which the policy may call tools (rollout.max_turns > 1).

A turn is one generation of the policy. It ends at end-of-sequence, at rollout.max_turn_tokens, or after a tool
call, written as in Qwen's and Hermes' chat templates:

    <tool_call>{"name": "calculator", "arguments": {"expression": "123456789*987654321"}}</tool_call>

(`</tool_call>` is a stop string of every turn). The call's tool runs (components/tools.py) and its answer is
appended to the conversation through rollout.tool_response_template (default `<tool_response>...</tool_response>`,
Hermes' tool message body), and the policy's next turn continues from there, up to rollout.max_turns turns and
rollout.max_new_tokens tokens in all (the policy's and the tools'). A tool's answer that does not fit the budget
ends the conversation; so the response always ends with the policy's own tokens.

Every turn is one `engine.generate` call over all the conversations still going (the engine batches them; vLLM's
prefix cache keeps what earlier turns computed, and the engine stays awake between turns). The response of a
sample is the whole conversation after the prompt; its `loss_mask` is 1 on the policy's tokens and 0 on the tools'
(their rollout log-probs are NaN), and its `extra` holds the transcript: `turns`, `tool_calls` (name, arguments,
answer, error) and `messages` (assistant and tool turns in order), which the reward sees in `extra_info`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

from components.rollout import Generation, SamplingParams
from components.tools import DEFAULT_TOOL_RESPONSE_TEMPLATE, ToolFunction, load_tools, run_tool

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TURN_SEED_STRIDE = 1_000_003
"""Turn t's sampling seed is the rollout's seed + t * this (each turn's draws differ)."""


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: object
    error: str | None = None
    """Why the call could not be read (then name and arguments are None)."""


def parse_tool_call(text: str) -> ToolCall | None:
    """The last complete `<tool_call>{...}</tool_call>` of a turn's text; None when there is none. A call whose
    body is not a JSON object with a string `name` comes back with `error` set (its answer is that error)."""
    end = text.rfind(TOOL_CALL_END)
    start = text.rfind(TOOL_CALL_START, 0, end) if end >= 0 else -1
    if start < 0:
        return None
    body = text[start + len(TOOL_CALL_START):end].strip()
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as problem:
        return ToolCall(None, None, f"the tool call is not valid JSON ({problem.msg} at character {problem.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(None, None, 'a tool call is {"name": "<tool>", "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return ToolCall(payload["name"], arguments)


@dataclass(frozen=True)
class MultiTurnSettings:
    tools: dict[str, ToolFunction]
    max_turns: int
    max_turn_tokens: int | None = None
    tool_timeout_s: float = 10.0
    tool_response_template: str = DEFAULT_TOOL_RESPONSE_TEMPLATE

    @classmethod
    def from_config(cls, rollout) -> "MultiTurnSettings":
        """From the run's `rollout` section (components.rollout.RolloutConfig)."""
        return cls(tools=load_tools(rollout.tools), max_turns=rollout.max_turns,
                   max_turn_tokens=rollout.max_turn_tokens, tool_timeout_s=rollout.tool_timeout_s,
                   tool_response_template=rollout.tool_response_template)


@dataclass
class Conversation:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    has_logprobs: bool = True
    turns: int = 0
    tool_calls: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish_reason: str = "length"
    done: bool = False

    def append(self, tokens: list[int], trained: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids.extend(tokens)
        self.loss_mask.extend([1 if trained else 0] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [math.nan] * len(tokens))


def loss_mask_of(segments: Sequence[tuple[int, bool]]) -> list[int]:
    """The loss mask of a response made of segments (length, the policy's own): 1 per policy token, 0 per tool
    token. [(3, True), (2, False), (1, True)] -> [1, 1, 1, 0, 0, 1]."""
    return [1 if trained else 0 for length, trained in segments for _ in range(length)]


@contextlib.contextmanager
def awake_between_turns(engine):
    """An engine that sleeps after every generation (vLLM sleep mode) stays awake until the last turn: sleeping
    would free the KV cache and the prefix cache the next turn reuses."""
    sleeps = bool(getattr(engine, "sleep_enabled", False))
    if sleeps:
        engine.sleep_enabled = False
    try:
        yield
    finally:
        if sleeps:
            engine.sleep_enabled = True
            engine.sleep()


def _turn_params(params: SamplingParams, turn: int, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(
        params, n=params.n if turn == 0 else 1, max_new_tokens=max_tokens,
        min_new_tokens=min(params.min_new_tokens, max_tokens) if turn == 0 else 0,
        stop=tuple(dict.fromkeys((*params.stop, TOOL_CALL_END))),
        seed=None if params.seed is None else params.seed + turn * TURN_SEED_STRIDE)


def _generate_turn(engine, contexts: list[list[int]], params: SamplingParams, logprob_rows: set[int] | None):
    if logprob_rows is not None and "with_logprobs" in inspect.signature(engine.generate).parameters:
        # the same conversations as in their first turn carry log-probs (vLLM; rollout.logprobs_fraction)
        return engine.generate(contexts, params, with_logprobs=logprob_rows)
    return engine.generate(contexts, params)


def generate_conversations(engine, tokenizer, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                           settings: MultiTurnSettings) -> list[Generation]:
    """`params.n` conversations per prompt, prompt-major like `engine.generate`; `params.max_new_tokens` is each
    conversation's token budget (the policy's tokens and the tools')."""
    budget = params.max_new_tokens
    turn_limit = min(settings.max_turn_tokens or budget, budget)
    eos = set(getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id])
    conversations: list[Conversation] = []
    with awake_between_turns(engine):
        for turn in range(settings.max_turns):
            active = [c for c in conversations if not c.done]
            if turn and not active:
                break
            left = [budget - len(c.response_ids) for c in active]
            turn_params = _turn_params(params, turn, min(turn_limit, max(left, default=budget)))
            if turn == 0:
                generations = engine.generate([list(ids) for ids in prompt_ids], turn_params)
                conversations = [Conversation(g.prompt_index, g.sample_index, list(prompt_ids[g.prompt_index]),
                                              has_logprobs=g.logprobs is not None) for g in generations]
                active, left = conversations, [budget] * len(conversations)
            else:
                rows = {row for row, c in enumerate(active) if c.has_logprobs}
                generations = _generate_turn(engine, [c.prompt_ids + c.response_ids for c in active], turn_params, rows)
            calls = [_take_turn(c, g, min(room, turn_limit), eos, tokenizer, turn + 1 < settings.max_turns)
                     for c, g, room in zip(active, generations, left)]
            _answer_calls([(c, call) for c, call in zip(active, calls) if call is not None], settings, tokenizer,
                          budget)
    return [_as_generation(c, tokenizer) for c in conversations]


def _take_turn(conversation: Conversation, generation: Generation, room: int, eos: set[int], tokenizer,
               more_turns: bool) -> ToolCall | None:
    """Add the policy's turn to the conversation; the tool call to answer, or None (the conversation ends)."""
    tokens = list(generation.response_ids)
    cut = len(tokens) > room  # one batched call per turn gave it more tokens than its own budget has left
    tokens = tokens[:room]
    logprobs = None if generation.logprobs is None else list(generation.logprobs[:len(tokens)])
    if logprobs is None:
        conversation.has_logprobs = False
    conversation.append(tokens, trained=True, logprobs=logprobs)
    conversation.turns += 1
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    conversation.messages.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
    ended_by_eos = bool(tokens) and tokens[-1] in eos
    call = None if cut or ended_by_eos else parse_tool_call(text)
    conversation.finish_reason = "length" if cut else generation.finish_reason
    if call is None or not more_turns:
        conversation.done = True
        return None
    return call


def _answer_calls(pending: list[tuple[Conversation, ToolCall]], settings: MultiTurnSettings, tokenizer,
                  budget: int) -> None:
    """Run the turn's tool calls side by side and append their answers (or end the conversations they overflow)."""
    if not pending:
        return

    def answer(call: ToolCall) -> tuple[str, str | None]:
        if call.error is not None:
            return f"error: {call.error}", call.error
        return run_tool(settings.tools, call.name, call.arguments, settings.tool_timeout_s)

    with ThreadPoolExecutor(max_workers=min(16, len(pending)), thread_name_prefix="tool-calls") as pool:
        answers = list(pool.map(answer, [call for _, call in pending]))
    for (conversation, call), (text, error) in zip(pending, answers):
        tokens = tokenizer(settings.tool_response_template.format(result=text), add_special_tokens=False)["input_ids"]
        record = {"name": call.name, "arguments": call.arguments, "answer": text, "error": error}
        conversation.tool_calls.append(record)
        # the next turn needs at least one token of its own: the response ends with the policy's tokens
        if len(conversation.response_ids) + len(tokens) >= budget:
            record["appended"] = False
            conversation.finish_reason, conversation.done = "length", True
            continue
        record["appended"] = True
        conversation.append(list(tokens), trained=False)
        conversation.messages.append({"role": "tool", "name": call.name, "content": text})


def _as_generation(conversation: Conversation, tokenizer) -> Generation:
    return Generation(
        prompt_index=conversation.prompt_index, sample_index=conversation.sample_index,
        response_ids=conversation.response_ids,
        logprobs=conversation.logprobs if conversation.has_logprobs else None,
        finish_reason=conversation.finish_reason,
        text=tokenizer.decode(conversation.response_ids, skip_special_tokens=True),
        extra={"turns": conversation.turns, "tool_calls": conversation.tool_calls, "messages": conversation.messages},
        loss_mask=conversation.loss_mask)


def generate_samples(engine, tokenizer, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                     rollout) -> list[Generation]:
    """The rollout's samples: `engine.generate` (one response per sample) under rollout.max_turns=1, else
    conversations with the tools of rollout.tools (`rollout`: the run's RolloutConfig)."""
    if rollout.max_turns <= 1:
        return engine.generate(prompt_ids, params)
    return generate_conversations(engine, tokenizer, prompt_ids, params, MultiTurnSettings.from_config(rollout))


def with_tool_trace(extra_info: str, generation: Generation) -> str:
    """A row's extra_info (JSON text) with the conversation's transcript added, as verl's agent loop hands
    tool traces to the reward in extra_info: `turns`, `tool_calls`, `messages`. Unchanged for single-turn samples."""
    if "turns" not in generation.extra:
        return extra_info
    decoded = json.loads(extra_info) if extra_info else None
    info = dict(decoded) if isinstance(decoded, dict) else ({} if decoded is None else {"value": decoded})
    info.update({name: generation.extra[name] for name in ("turns", "tool_calls", "messages")})
    return json.dumps(info, default=str)


def multi_turn_metrics(generations: Sequence[Generation]) -> dict[str, float]:
    """rollout/turns/mean, rollout/tool_calls/mean (per sample), rollout/tool_errors (share of calls that answered
    an error) and rollout/tool_token_frac (share of response tokens that are the tools')."""
    if not generations or "turns" not in generations[0].extra:
        return {}
    calls = [call for g in generations for call in g.extra["tool_calls"]]
    tokens = sum(len(g.response_ids) for g in generations)
    tool_tokens = sum(len(g.loss_mask) - sum(g.loss_mask) for g in generations if g.loss_mask is not None)
    return {"rollout/turns/mean": sum(g.extra["turns"] for g in generations) / len(generations),
            "rollout/tool_calls/mean": len(calls) / len(generations),
            "rollout/tool_errors": sum(call["error"] is not None for call in calls) / len(calls) if calls else 0.0,
            "rollout/tool_token_frac": tool_tokens / tokens if tokens else 0.0}
