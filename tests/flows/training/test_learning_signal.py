"""flows.training.learning_signal: a run whose steps have no learning signal warns once, at the Nth step in a row,
names the cause, and warns again only after a step with a signal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flows.config import build_config
from flows.training import learning_signal
from flows.training.learning_signal import (EQUAL_REWARDS, NO_SIGNAL_TAG, NO_UPDATE, NoSignalWatch, no_signal_cause,
                                            watch_learning_signal)

EQUAL = {"critic/score/mean": 0.0, "critic/score/equal_group_frac": 1.0, "response_length/clip_ratio": 0.5,
         "actor/grad_norm": 0.0, "actor/update_rms_ratio": 0.0}
"""The issue's step: score 0 for every sample, so nothing to learn and nothing moved."""
LEARNING = {"critic/score/mean": 0.25, "critic/score/equal_group_frac": 0.5, "response_length/clip_ratio": 0.0,
            "actor/grad_norm": 0.8, "actor/update_rms_ratio": 2e-6}
STILL = {"critic/score/mean": 0.5, "critic/score/equal_group_frac": 0.25, "critic/advantages/mean": 0.0,
         "actor/grad_norm": 0.4, "actor/update_rms_ratio": 0.0}
"""Rewards that differ, an update that moved no weight (a learning rate lost in the precision)."""


def _config(steps: int = 3, **sections):
    return build_config({"trainer": {"no_signal_steps": steps}, **sections})


def _watch(steps: int = 3, **sections):
    reports: list[tuple[int, str]] = []
    watch = NoSignalWatch(_config(steps, **sections), lambda step, line: reports.append((step, line)))
    return watch, reports


def test_the_cause_of_a_step_prefers_equal_rewards_and_missing_metrics_say_nothing():
    assert no_signal_cause(EQUAL) == EQUAL_REWARDS
    assert no_signal_cause(STILL) == NO_UPDATE
    assert no_signal_cause({**LEARNING, "actor/grad_norm": 0.0}) == NO_UPDATE
    assert no_signal_cause(LEARNING) is None
    # rollout.n=1: no equal_group_frac; an update that moved: signal. No metrics at all: nothing known.
    assert no_signal_cause({"actor/grad_norm": 0.3, "actor/update_rms_ratio": 1e-7}) is None
    assert no_signal_cause({}) is None


def test_it_warns_at_exactly_the_nth_step_once_and_names_equal_rewards():
    watch, reports = _watch(3)
    clip_ratios = [0.5, 1.0, 0.5, 0.0]
    lines = [watch.observe(step, {**EQUAL, "response_length/clip_ratio": ratio})
             for step, ratio in zip(range(1, 5), clip_ratios)]
    expected = ("warning: no learning signal for 3 steps (steps 1-3): every group of samples got the same reward "
                "(mean score 0.000), so every advantage is 0; check the reward function and the answer format "
                "(rlhf doctor CONFIG --data scores the model before training), the response length limit "
                "(rollout.max_new_tokens=16, response_length/clip_ratio 0.67) and the learning rate "
                "(actor.optim.lr=1e-05)")
    assert lines == [None, None, expected, None]  # step 4 is the same streak: no second line
    assert reports == [(3, expected)]


def test_a_step_with_signal_rearms_it_and_a_broken_streak_never_warns():
    watch, reports = _watch(2)
    for step, metrics in enumerate([EQUAL, LEARNING, EQUAL, LEARNING, EQUAL, EQUAL, EQUAL, LEARNING, EQUAL, EQUAL],
                                   start=1):
        watch.observe(step, metrics)
    assert [step for step, _ in reports] == [6, 10]
    assert reports[0][1].startswith("warning: no learning signal for 2 steps (steps 5-6): ")
    assert reports[1][1].startswith("warning: no learning signal for 2 steps (steps 9-10): ")


def test_zero_steps_turns_it_off():
    watch, reports = _watch(0)
    assert [watch.observe(step, EQUAL) for step in range(1, 20)] == [None] * 19
    assert reports == []


def test_an_update_that_moved_nothing_points_at_the_learning_rate_clipping_and_precision():
    watch, _ = _watch(2, model={"compute_dtype": "bfloat16", "master_dtype": "bfloat16"},
                      actor={"optim": {"lr": 1e-6, "grad_clip": 0.5}})
    assert watch.observe(7, STILL) is None
    line = watch.observe(8, {**STILL, "actor/grad_norm": 0.2, "actor/skipped_steps": 1.0})
    assert line == ("warning: no learning signal for 2 steps (steps 7-8): the actor's update moved no weight "
                    "(actor/update_rms_ratio 0, actor/grad_norm 0.3); check the learning rate (actor.optim.lr=1e-06), "
                    "gradient clipping (actor.optim.grad_clip=0.5) and the precision (model.master_dtype=bfloat16, "
                    "model.compute_dtype=bfloat16); optimizer steps skipped for a non-finite gradient: 1 "
                    "(actor/skipped_steps)")


def test_a_zero_gradient_points_at_the_rewards_and_advantages_first():
    """rollout.n=1 (groups of one: no equal_group_frac) with score 0 everywhere: the gradient is 0."""
    watch, _ = _watch(1, rollout={"n": 1})
    line = watch.observe(4, {"critic/score/mean": 0.0, "critic/advantages/mean": 0.0, "actor/grad_norm": 0.0,
                             "actor/update_rms_ratio": 0.0})
    assert line == ("warning: no learning signal for 1 step (step 4): the actor's gradient was 0 (actor/grad_norm "
                    "0), so its update moved nothing; check the rewards and the advantages (critic/score/mean 0.000, "
                    "critic/advantages/mean 0), then the learning rate (actor.optim.lr=1e-05), gradient clipping "
                    "(actor.optim.grad_clip=1) and the precision (model.master_dtype=float32, "
                    "model.compute_dtype=float32)")


@pytest.mark.parametrize("sections, so", [
    ({"algorithm": {"adv_estimator": "rloo"}}, "so every advantage is 0"),
    ({"algorithm": {"adv_estimator": "gae"}}, "so no sample is better than another of its prompt"),
    ({"algorithm": {"use_kl_in_reward": True}}, "so no sample is better than another of its prompt"),
])
def test_equal_rewards_say_every_advantage_is_0_only_where_it_is(sections, so):
    watch, _ = _watch(1, **sections)
    assert f"(mean score 1.000), {so}; check" in watch.observe(1, {**EQUAL, "critic/score/mean": 1.0})


def test_the_commoner_cause_of_the_streak_is_named():
    watch, _ = _watch(3)
    watch.observe(1, STILL)
    watch.observe(2, EQUAL)
    assert ": the actor's update moved no weight" in watch.observe(3, STILL)
    watch.observe(4, LEARNING)
    for step in (5, 6):
        watch.observe(step, {**EQUAL, "response_length/clip_ratio": 0.0})
    assert ": every group of samples got the same reward" in watch.observe(7, STILL)


def test_the_run_gets_the_line_on_the_terminal_as_an_mlflow_tag_and_a_prefect_artifact(monkeypatch):
    printed, tags, artifacts = [], [], []
    monkeypatch.setattr(learning_signal, "warn", printed.append)
    tracker = SimpleNamespace(set_tags=tags.append)
    state = SimpleNamespace(config=_config(1), tracker=tracker,
                            artifacts=SimpleNamespace(warning=lambda *args: artifacts.append(args)))
    line = watch_learning_signal(state).observe(2, EQUAL)
    assert printed == [line] and tags == [{NO_SIGNAL_TAG: line}] and artifacts == [("no-signal", 2, line)]

    def unreachable(tags):
        raise ConnectionError("tracking server down")

    tracker.set_tags, printed[:] = unreachable, []
    watch_learning_signal(state).observe(3, EQUAL)  # the run goes on
    assert printed[1] == f"warning: could not tag the MLflow run with {NO_SIGNAL_TAG}: tracking server down"
