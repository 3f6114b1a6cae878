"""What every stage uses: its result (`StageResult`), its timings, the step's batches through the run's
`Batches` (flows/runtime/batches.py), the rollout's weights through the run's transport
(flows/runtime/weights/), and the scoring of a batch (the reward stage and validation alike).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Iterator, TypedDict

from components.rewards import score_responses
from flows.config import Config
from flows.runtime.batches import batches_for
from flows.runtime.weights import transport_for
from flows.training.roles import get_role


class StageResult(TypedDict):
    path: str
    metrics: dict[str, float]


@contextmanager
def timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = time.perf_counter() - start


def read_batch(config: Config, step: int, stage: str, rollout=None):
    """A stage's output for `step`, aligned to the rollout's samples when `rollout` is given."""
    expected = None if rollout is None else rollout.column("uid").to_pylist()
    return batches_for(config).read(step, stage, expected_uids=expected)


def write_batch(config: Config, step: int, stage: str, columns) -> str:
    return batches_for(config).write(step, stage, columns)


def sync_rollout_weights(config: Config, step: int, sync: str | None = None) -> dict[str, float]:
    """Give the rollout engine the actor's weights published for `step`, if it holds older ones (`sync`: the
    hand-over the driver arranged with the actor's worker, when weights are streamed between workers)."""
    return transport_for(config).sync_weights(get_role(config, "rollout"), step, sync)


def score_batch(config: Config, prompt_ids, response_texts, ground_truths, data_sources, extra_infos) -> list[float]:
    """Scores of one batch. A reward model reads the prompt as the policy saw it (decoded with the chat
    template's special tokens, in training and validation alike); a function gets each row's fields."""
    scorer = get_role(config, "reward")
    if config.reward.kind == "model":
        prompt_texts = get_role(config, "tokenizer").batch_decode(list(prompt_ids), skip_special_tokens=False)
        return scorer.score(prompt_texts, list(response_texts))
    return score_responses(scorer, response_texts, ground_truths, data_sources,
                           [json.loads(info) for info in extra_infos])
