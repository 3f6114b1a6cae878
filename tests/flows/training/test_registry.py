"""flows.training.registry: the stages declared in flows/training/stages.py against the batch schema
(storage/schema.py), the roles that serve them, resume's skippable set, and the declaration's rules."""

from __future__ import annotations

import pytest

import flows.training.stages  # noqa: F401  (importing it fills the registry)
from flows.runtime.weights import changes_policy_weights, needs_policy_weights
from flows.training import registry
from flows.training.registry import STAGES, WORKER_ROLES, StageSpec, role_stages, stage
from storage import schema


def test_every_stage_file_of_the_schema_is_the_output_of_a_stage_and_nothing_else_is():
    files = {spec.output for spec in STAGES.values()
             if spec.output is not None and not spec.output.startswith(("weights/", "checkpoint/"))}
    assert files == set(schema.STAGES)


def test_the_other_outputs_name_a_trained_roles_weights_or_checkpoint():
    others = {spec.name: spec.output for spec in STAGES.values()
              if spec.output is not None and spec.output.startswith(("weights/", "checkpoint/"))}
    assert others == {"update_actor": "weights/actor", "warm_start": "weights/actor",
                      "checkpoint_actor": "checkpoint/actor", "checkpoint_critic": "checkpoint/critic"}


def test_every_stage_runs_in_a_worker_role_or_the_driver():
    assert {spec.role for spec in STAGES.values()} <= {*WORKER_ROLES, "driver"}
    assert all(name == spec.name for name, spec in STAGES.items())


def test_the_rollout_worker_serves_generation_and_validation():
    assert {spec.name for spec in role_stages("rollout")} == {"rollout", "validate"}  # served in any order
    assert {spec.name for spec in role_stages("driver")} == {"advantages"}
    assert role_stages("nobody") == []


def test_the_stages_a_resumed_run_may_skip():
    assert {name for name, spec in STAGES.items() if spec.skippable} == {
        "rollout", "reward", "reference", "values", "old_logprobs", "advantages", "validate", "warm_start"}
    assert not STAGES["validate"].per_sample and STAGES["reward"].per_sample
    assert not STAGES["warm_start"].all_ranks and STAGES["update_actor"].all_ranks


def test_the_stages_that_sample_with_the_policy_declare_it_and_the_actor_sends_it():
    """The driver pairs them (flows/runtime/weights/handover.py); those writing weights/actor change it."""
    assert {name for name, spec in STAGES.items() if needs_policy_weights(spec)} == {"rollout", "validate"}
    assert {name for name, spec in STAGES.items() if spec.sends_policy_weights} == {"send_weights"}
    assert STAGES["rollout"].weights_sender is STAGES["validate"].weights_sender is STAGES["send_weights"]
    assert STAGES["send_weights"].role == "actor"
    assert {name for name, spec in STAGES.items() if changes_policy_weights(spec)} == {"update_actor", "warm_start"}


@pytest.fixture
def throwaway():
    """Removes the stages a test declares from the registry afterwards."""
    before = dict(STAGES)
    yield
    for name in set(STAGES) - set(before):
        del STAGES[name]
    assert STAGES == before


def test_a_stage_declared_twice_is_refused(throwaway):
    def registry_test_stage(config, step):
        return {"path": "", "metrics": {}}

    stage(role="reward")(registry_test_stage)
    with pytest.raises(ValueError, match="stage 'registry_test_stage' is declared twice"):
        stage(role="actor")(registry_test_stage)
    assert STAGES["registry_test_stage"].role == "reward"
    with pytest.raises(ValueError, match="stage 'rollout' is declared twice"):
        stage(role="rollout")(flows.training.stages.rollout.function)


def test_a_stage_of_an_unknown_role_is_refused(throwaway):
    with pytest.raises(ValueError, match="stage role 'trainer': one of rollout, actor, reference, critic, reward, driver"):
        stage(role="trainer")
    with pytest.raises(ValueError, match="stage role 'tokenizer'"):
        stage(role="tokenizer", output="rollout")


def test_a_declaration_is_callable_and_calls_its_function(throwaway):
    calls = []

    def registry_test_call(config, step, kl_coef=0.0):
        """Doubles the step."""
        calls.append((config, step, kl_coef))
        return {"path": "p", "metrics": {"step2": 2 * step}}

    spec = stage(role="driver", output="advantages", skippable=True)(registry_test_call)
    assert isinstance(spec, StageSpec) and registry.STAGES["registry_test_call"] is spec
    assert (spec.name, spec.role, spec.output, spec.skippable, spec.per_sample, spec.all_ranks) == (
        "registry_test_call", "driver", "advantages", True, True, True)
    assert spec("config", 3, kl_coef=0.5) == {"path": "p", "metrics": {"step2": 6}}
    assert calls == [("config", 3, 0.5)] and spec.__doc__ == "Doubles the step."
    assert spec in role_stages("driver")


def test_a_stage_spec_builds_its_prefect_task_once():
    task = STAGES["reward"].task
    assert task is STAGES["reward"].task and task.name == "reward"
