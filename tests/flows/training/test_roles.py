"""flows.training.roles: trained_role hands a stage the actor or critic holding the training state it needs,
rebuilt from the step's checkpoint (flows.runtime.recovery) when the resident one holds another."""

from __future__ import annotations

import json

import pytest

from flows.config import build_config, layout_for
from flows.runtime.recovery import LATEST, RoleStateError, restore_point
from flows.runtime.residents import release_run
from flows.training import roles
from flows.training.roles import trained_role


class _Role:
    def __init__(self, restored):
        self.restored, self.state_step, self.closed = restored, restored or 0, False

    def close(self):
        self.closed = True


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A config whose run folder has committed checkpoints 1 and 3 (latest 3), and an actor builder
    that records which checkpoint it was asked to restore (None: the initial weights)."""
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)}})
    layout = layout_for(config)
    for step in (1, 3):
        folder = tmp_path / "r" / "checkpoints" / str(step)
        assert layout.checkpoint_dir(step) == str(folder), layout.checkpoint_dir(step)
        folder.mkdir(parents=True)
        (folder / "driver.json").write_text("{}")
    (tmp_path / "r" / "checkpoints" / "latest.json").write_text(json.dumps({"step": 3}))
    built = []

    def build(config, restore=LATEST):
        built.append(_Role(restore_point(layout_for(config), "actor", restore)[0]))
        return built[-1]

    monkeypatch.setitem(roles.BUILDERS, "actor", build)
    yield config, built
    release_run(config)


def test_a_role_holding_the_needed_state_is_used_as_it_is(trained):
    config, built = trained
    first = trained_role(config, "actor", 3, "update_actor")  # built from the latest checkpoint
    assert [role.restored for role in built] == [3]
    assert trained_role(config, "actor", 3, "old_logprobs") is first and len(built) == 1


def test_a_role_left_midway_is_rebuilt_from_the_checkpoint_of_the_step(trained):
    config, built = trained
    trained_role(config, "actor", 3, "update_actor").state_step = None  # an update that raised midway
    again = trained_role(config, "actor", 3, "update_actor")
    assert [role.restored for role in built] == [3, 3] and again is built[1] and built[0].closed
    again.state_step = 5  # e.g. a long-lived worker that ran further
    assert trained_role(config, "actor", 1, "checkpoint_actor").restored == 1
    assert trained_role(config, "actor", 0, "old_logprobs").restored is None  # step 0: the initial weights
    assert [role.restored for role in built] == [3, 3, 1, None]


def test_a_state_no_checkpoint_has_fails_with_one_line_saying_what_to_do(trained):
    config, _ = trained
    with pytest.raises(RoleStateError) as error:
        trained_role(config, "actor", 2, "update_actor")
    assert str(error.value) == (
        "stage update_actor at step 2: the actor holds the training state of step 3 and no checkpoint has step 2's "
        "(its worker was replaced, or an attempt of the stage stopped midway); resume the run: rlhf resume r "
        "(restarts at step 3)")


def test_the_first_use_of_a_role_whose_blocks_compile_says_so_once(trained, monkeypatch):
    """model.compile compiles the blocks at the first forward (about 30 s for a 0.5B model on an H200): the stage
    that first asks for the role prints one line before it, the next ones nothing."""
    config, built = trained
    lines = []
    monkeypatch.setattr(roles, "progress", lines.append)
    first = trained_role(config, "actor", 3, "update_actor")
    assert lines == []  # a model without compiled blocks (the CPU's, model.compile=false)
    first.model = type("Model", (), {"rlhf_compile_pending": True})()
    assert trained_role(config, "actor", 3, "update_actor") is first
    assert lines == ["compiling the actor's blocks (first step) ..."]
    trained_role(config, "actor", 3, "old_logprobs")
    assert lines == ["compiling the actor's blocks (first step) ..."] and not first.model.rlhf_compile_pending


def test_an_update_that_compiles_the_blocks_again_says_so_once_per_kind_of_shape(tmp_path, monkeypatch):
    """model.compile's blocks compile again for a new kind of batch shape (the first new sequence length, the first
    new row count, a one-row micro-batch); on a GPU that is seconds inside one update, and the update after the first
    that pays it says so. A real tiny model, its blocks compiled as model.compile compiles them (torch's
    aot_eager backend here: the same guards and recompiles as inductor, no C++ compiler)."""
    import torch

    from components.models import compile_layers, load_causal_lm
    from components.tiny import build_tiny_model

    torch._dynamo.reset()
    model = load_causal_lm(str(build_tiny_model(tmp_path / "model")))
    assert compile_layers(model, backend="aot_eager") > 0
    model.rlhf_updates = 0  # as roles._compile_if_asked marks a model whose blocks it compiled
    instance = type("Role", (), {"model": model})()
    lines = []
    monkeypatch.setattr(roles, "progress", lines.append)

    def update(rows, length):
        ids = torch.randint(3, 200, (rows, length))
        with roles.announcing_recompiles("actor", instance):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float().mean().backward()
        return len(lines)

    try:
        # first update (announced before it by trained_role), same shape, a new length, the lengths dynamic now, a
        # new row count, both seen, one row
        counts = [update(4, 6), update(4, 6), update(4, 9), update(4, 11), update(3, 11), update(3, 7), update(1, 7)]
        assert counts == [0, 0, 1, 1, 2, 2, 3]
        assert lines[0].startswith("the actor's blocks compiled again for a new kind of batch shape (1 graph(s); "
                                   "this update took ")
    finally:
        torch._dynamo.reset()  # the next tests start without these compiled graphs


def test_a_lora_runs_reference_is_the_actors_model_in_the_actors_process_only(tmp_path, monkeypatch):
    """Under LoRA the reference is the resident actor's model with its adapter disabled, in one process and under
    workers (the actor's worker serves its stages); a worker of another role refuses to build it (it would load a
    second actor)."""
    from components.reference import AdapterReference
    from flows.runtime import worker

    for execution in ("local", "workers"):
        config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)}},
                              ["model.lora_rank=4", "actor.use_kl_loss=true", f"trainer.execution={execution}"])
        assert isinstance(roles.BUILDERS["reference"](config), AdapterReference)
        assert roles._loading_note(config, "reference") is None  # nothing loads: no progress line
    monkeypatch.setattr(worker, "CURRENT", type("Beat", (), {"state": {"role": "actor"}})())
    assert isinstance(roles.BUILDERS["reference"](config), AdapterReference)
    monkeypatch.setattr(worker, "CURRENT", type("Beat", (), {"state": {"role": "reference"}})())
    with pytest.raises(ValueError, match=r"^model.lora_rank=4: the reference is the actor's model with its adapter "
                                         r"disabled and runs in the actor's worker, not in this reference worker; stop "
                                         r"it and start the actor's with `rlhf worker --role actor --also-serve "
                                         r"reference`$"):
        roles.BUILDERS["reference"](config)
