"""The stage registry: every stage declared once, where it is defined.

    @stage(role="rollout", output="rollout", skippable=True)
    def rollout(config, step): ...

A declaration says which role's worker runs the stage ("driver": the flow's own process), what it
writes (a stage file of storage/schema.py, or "weights/<role>" / "checkpoint/<role>", or nothing), and
whether a resumed run may skip it once that output and its metrics are stored, and whether it samples
with the policy's weights (`needs_policy_weights`: the driver arranges their hand-over, pairing it with the
stage declared `sends_policy_weights`; flows/runtime/weights/handover.py). The rest derives from it: the
Prefect task of each stage (`StageSpec.task`), which stages a role's worker serves (`role_stages`), resume's
skip rule (flows/runtime/recovery.py), and tests/flows/training/test_registry.py checks the schema's stage
list against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

WORKER_ROLES = ("rollout", "actor", "reference", "critic", "reward")
"""The roles that run in a worker of their own under trainer.execution=workers (a LoRA run's reference runs in the
actor's: flows.config.worker_role)."""
DRIVER = "driver"
SHARDED_ROLES = ("actor", "critic")
"""Roles that may span several GPUs (FSDP2 ranks, components/distributed.py)."""


@dataclass(eq=False)
class StageSpec:
    """One stage: its function and its declaration. Calling it calls the function."""

    name: str
    function: Callable[..., dict]
    role: str
    output: str | None
    skippable: bool
    per_sample: bool
    """Its output has one row per sample of the step (resume checks the count)."""
    all_ranks: bool
    """A sharded role runs it on every rank (collectives inside); False: rank 0 alone."""
    needs_policy_weights: bool = False
    """It samples with a policy version: `(config, step[, version], sync=None)`, the driver names `sync`."""
    sends_policy_weights: bool = False
    """The actor's side of a streamed hand-over: `(config, version, sync, for_stage, for_step)`."""
    _task: Any = field(default=None, repr=False)

    def __call__(self, *args, **kwargs) -> dict:
        return self.function(*args, **kwargs)

    @property
    def task(self):
        """The Prefect task that runs this stage (flows/runtime/tasks.py adds the worker's bookkeeping)."""
        if self._task is None:
            # on use: the Prefect task wrapper; the registry stays importable without Prefect
            from flows.runtime.tasks import stage_task

            self._task = stage_task(self.function, self.name)
        return self._task

    @property
    def weights_sender(self) -> StageSpec:
        """The stage that sends this one the policy's weights when they are streamed (needs_policy_weights)."""
        senders = [spec for spec in STAGES.values() if spec.sends_policy_weights]
        assert self.needs_policy_weights and len(senders) == 1, (self.name, [spec.name for spec in senders])
        return senders[0]


STAGES: dict[str, StageSpec] = {}
"""Stage name -> its declaration, in the order of definition (importing flows/training/stages.py fills it)."""


def stage(*, role: str, output: str | None = None, skippable: bool = False, per_sample: bool = True,
          all_ranks: bool = True, needs_policy_weights: bool = False,
          sends_policy_weights: bool = False) -> Callable[[Callable[..., dict]], StageSpec]:
    if role not in (*WORKER_ROLES, DRIVER):
        raise ValueError(f"stage role {role!r}: one of {', '.join((*WORKER_ROLES, DRIVER))}")

    def register(function: Callable[..., dict]) -> StageSpec:
        if function.__name__ in STAGES:
            raise ValueError(f"stage {function.__name__!r} is declared twice")
        spec = StageSpec(function.__name__, function, role, output, skippable, per_sample, all_ranks,
                         needs_policy_weights, sends_policy_weights)
        spec.__doc__ = function.__doc__
        STAGES[spec.name] = spec
        return spec

    return register


def role_stages(role: str) -> list[StageSpec]:
    """The stages a role's worker serves."""
    return [spec for spec in STAGES.values() if spec.role == role]
