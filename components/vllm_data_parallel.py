"""Several vLLM engines side by side (rollout.engines): `DataParallelRollout` gives each a contiguous share of
the prompts (`prompt_shares`) and behaves as one engine to the stages.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from components.rollout import Generation, SamplingParams, logprob_prompts
from components.vllm_rollout import VLLMRolloutEngine
from components.weight_sync.receiver import RemoteWeights
from components.weight_sync.versions import InMemoryWeights


def prompt_shares(count: int, parts: int) -> list[tuple[int, int]]:
    """`count` prompts cut into `parts` contiguous [start, stop) shares whose sizes differ by at most one
    (empty shares dropped). Contiguous: a prompt's n samples stay in one engine (its prefix cache)."""
    bounds = [part * count // parts for part in range(parts + 1)]
    return [(start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


class DataParallelRollout:
    """Several vLLM engines side by side (rollout.engines), each generating for a contiguous share of
    the prompts in a thread of its own; weights load into all of them, sleep and wake apply to all.

    Each engine has its own engine-core process, so their per-step CPU work (scheduling, sampling,
    output handling) runs in parallel, which a small model's decoding may be waiting on. The batch's
    result is the one engine's, prompt for prompt: seeds and the prompts given log-probs are those
    of the whole batch. Implements `components.protocols.RolloutRole` (built by flows.training.engines for
    rollout.engine=vllm with rollout.engines > 1).
    """

    weights_version: int | None
    last_metrics: dict[str, float]
    """The slowest engine's value of each metric of the last call."""

    def __init__(self, engines: list[VLLMRolloutEngine]):
        if not engines:
            raise ValueError("DataParallelRollout needs at least one engine")
        self.engines = engines
        self.tokenizer = engines[0].tokenizer
        self.start_seconds = sum(engine.start_seconds for engine in engines)
        self.weights_version = None
        self.last_metrics = {}

    @property
    def weights_path(self) -> str | None:
        return self.engines[0].weights_path

    @property
    def asleep(self) -> bool:
        return all(engine.asleep for engine in self.engines)

    @property
    def sleep_enabled(self) -> bool:
        return self.engines[0].sleep_enabled

    @sleep_enabled.setter
    def sleep_enabled(self, value: bool) -> None:
        for engine in self.engines:
            engine.sleep_enabled = value

    def _each(self, calls: list) -> list:
        """Run one call per engine, in parallel; the first error is raised once all have finished."""
        if len(calls) == 1:
            return [calls[0]()]
        with ThreadPoolExecutor(len(calls), thread_name_prefix="rlhf-engine") as pool:
            futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]

    def _gather_metrics(self, engines) -> None:
        # The engines work in parallel: the slowest one's time is the batch's.
        self.last_metrics = {}
        for engine in engines:
            for name, value in engine.last_metrics.items():
                self.last_metrics[name] = max(value, self.last_metrics.get(name, value))

    def load_weights(self, source: str | InMemoryWeights | RemoteWeights) -> None:
        if isinstance(source, str):
            self._each([lambda engine=engine: engine.load_weights(source) for engine in self.engines])
        else:  # one stream at a time: the live model is read by one sender (a pull of its own per engine)
            for engine in self.engines:
                engine.load_weights(source)
        self._gather_metrics(self.engines)

    def sleep(self) -> None:
        self._each([engine.sleep for engine in self.engines])

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """n samples for every prompt, prompt-major, as one engine would return them."""
        with_logprobs = logprob_prompts(len(prompt_ids), params.logprobs_fraction)
        shares = prompt_shares(len(prompt_ids), len(self.engines))
        busy = self.engines[:len(shares)]
        results = self._each([
            lambda engine=engine, start=start, stop=stop: engine.generate(
                prompt_ids[start:stop], params, first_index=start, with_logprobs=with_logprobs)
            for engine, (start, stop) in zip(busy, shares)])
        self._gather_metrics(busy)
        return [generation for result in results for generation in result]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
