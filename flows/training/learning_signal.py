"""A run that cannot learn says so: one warning per streak of steps without a learning signal.

A step has no learning signal when
- every group of samples got the same reward (`critic/score/equal_group_frac` 1.0): no sample of a prompt is
  better than another, so GRPO's and RLOO's advantages are all 0 and any estimator has nothing to prefer; or
- the actor's update moved nothing (`actor/update_rms_ratio` 0, or `actor/grad_norm` 0 where logged).
After `trainer.no_signal_steps` such steps in a row (0: never), one line names the cause (the commoner of the
streak's, equal rewards on a tie) and what to check. It goes to the terminal (flows.runtime.console.warn), to
MLflow as the tag `rlhf.warning.no_signal` and to Prefect as a markdown artifact, once per streak: a step with a
signal re-arms the watch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from flows.config import Config
from flows.runtime.console import warn
from flows.runtime.driver import RunState

NO_SIGNAL_TAG = "rlhf.warning.no_signal"
EQUAL_REWARDS, NO_UPDATE = "equal_rewards", "no_update"
GROUP_BASELINES = frozenset({"grpo", "grpo_no_std", "rloo"})
"""Estimators whose advantage is a sample's score against its group's: 0 for a group of equal scores."""


def no_signal_cause(metrics: dict[str, float]) -> str | None:
    """Why a step's metrics show no learning signal (EQUAL_REWARDS first, then NO_UPDATE), or None when they
    show one. A metric the step lacks (no group of two samples, no update) says nothing either way."""
    if metrics.get("critic/score/equal_group_frac") == 1.0:
        return EQUAL_REWARDS
    if metrics.get("actor/update_rms_ratio") == 0.0 or metrics.get("actor/grad_norm") == 0.0:
        return NO_UPDATE
    return None


def _mean(streak: list[dict[str, float]], name: str) -> float | None:
    values = [metrics[name] for metrics in streak if name in metrics]
    return sum(values) / len(values) if values else None


def _equal_rewards(config: Config, streak: list[dict[str, float]]) -> str:
    algorithm = config.algorithm
    zero = algorithm.adv_estimator in GROUP_BASELINES and not algorithm.use_kl_in_reward
    clip_ratio = _mean(streak, "response_length/clip_ratio")
    limit = f"rollout.max_new_tokens={config.rollout.max_new_tokens}" + (
        f", response_length/clip_ratio {clip_ratio:.2f}" if clip_ratio is not None else "")
    score = _mean(streak, "critic/score/mean") or 0.0
    return (f"every group of samples got the same reward (mean score {score:.3f}), "
            f"so {'every advantage is 0' if zero else 'no sample is better than another of its prompt'}; check "
            f"the reward function and the answer format (rlhf doctor CONFIG --data scores the model before "
            f"training), the response length limit ({limit}) and the learning rate "
            f"(actor.optim.lr={config.actor.optim.lr:g})")


def _no_update(config: Config, streak: list[dict[str, float]]) -> str:
    grad_norm, ratio = _mean(streak, "actor/grad_norm"), _mean(streak, "actor/update_rms_ratio")
    skipped = sum(metrics.get("actor/skipped_steps", 0.0) for metrics in streak)
    check = (f"the learning rate (actor.optim.lr={config.actor.optim.lr:g}), gradient clipping "
             f"(actor.optim.grad_clip={config.actor.optim.grad_clip:g}) and the precision "
             f"(model.master_dtype={config.model.master_dtype}, model.compute_dtype={config.model.compute_dtype})")
    if skipped:
        check += f"; optimizer steps skipped for a non-finite gradient: {skipped:.0f} (actor/skipped_steps)"
    if grad_norm == 0.0:
        score, advantage = _mean(streak, "critic/score/mean") or 0.0, _mean(streak, "critic/advantages/mean") or 0.0
        return (f"the actor's gradient was 0 (actor/grad_norm 0), so its update moved nothing; check the rewards and "
                f"the advantages (critic/score/mean {score:.3f}, critic/advantages/mean {advantage:.3g}), then {check}")
    measured = f", actor/grad_norm {grad_norm:.3g}" if grad_norm is not None else ""
    return f"the actor's update moved no weight (actor/update_rms_ratio {ratio or 0.0:g}{measured}); check {check}"


def no_signal_line(config: Config, steps: list[int], streak: list[dict[str, float]]) -> str:
    """The warning for a streak: `steps` (as MLflow numbers them) and their metrics, every one without signal."""
    causes = [no_signal_cause(metrics) for metrics in streak]
    cause = EQUAL_REWARDS if causes.count(EQUAL_REWARDS) >= causes.count(NO_UPDATE) else NO_UPDATE
    why = _equal_rewards(config, streak) if cause == EQUAL_REWARDS else _no_update(config, streak)
    span = f"{len(steps)} steps (steps {steps[0]}-{steps[-1]})" if len(steps) > 1 else f"1 step (step {steps[0]})"
    return f"warning: no learning signal for {span}: {why}"


@dataclass
class NoSignalWatch:
    """Counts the steps in a row without a learning signal; at `trainer.no_signal_steps` of them, calls `report`
    (step, line) once and returns the line, until a step with a signal re-arms it."""

    config: Config
    report: Callable[[int, str], None] = lambda step, line: None
    steps: list[int] = field(default_factory=list)
    streak: list[dict[str, float]] = field(default_factory=list)
    warned: bool = False

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """Step `step` (1-based, MLflow's step) finished with `metrics`; the warning line when it is due."""
        needed = self.config.trainer.no_signal_steps
        if not needed:
            return None
        if no_signal_cause(metrics) is None:
            self.steps, self.streak, self.warned = [], [], False
            return None
        if self.warned:
            return None
        self.steps.append(step)
        self.streak.append(dict(metrics))
        if len(self.steps) < needed:
            return None
        self.warned = True
        line = no_signal_line(self.config, self.steps, self.streak)
        self.report(step, line)
        return line


def watch_learning_signal(state: RunState) -> NoSignalWatch:
    """The run's watch: its warning goes to the terminal, the MLflow run (a tag) and the Prefect run (an
    artifact). The tag and the artifact are best effort: they never stop the run."""
    def report(step: int, line: str) -> None:
        warn(line)
        try:
            state.tracker.set_tags({NO_SIGNAL_TAG: line})
        except Exception as error:  # noqa: BLE001 - a warning about the run, not a reason to end it
            warn(f"warning: could not tag the MLflow run with {NO_SIGNAL_TAG}: {error}")
        state.artifacts.warning("no-signal", step, line)

    return NoSignalWatch(state.config, report)
