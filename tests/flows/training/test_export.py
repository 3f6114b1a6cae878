"""`flows.training.export` on a simulated run folder: weights as update_actor publishes them, tokenizer from run.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from flows.tools.cli import add_export_parser, cmd_export
from flows.training.export import EXPORT_INFO, export_run
from storage import RunLayout, atomic_directory
from storage.layout import COMMITTED_MARKER

RUN = "exp"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from components.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _perturbed(model_dir: Path, seed: int):
    """The tiny model with weights changed by `seed`, as an RL update would leave it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    return model


def _publish(layout: RunLayout, step: int, model) -> dict[str, torch.Tensor]:
    """Publish weights like flows.training.stages.update_actor does (no tokenizer files); return the tensors."""
    with atomic_directory(layout.fs, layout.weights_dir("actor", step)) as local:
        model.save_pretrained(local)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture()
def run_root(tmp_path, tiny_model_dir):
    """A run folder with committed actor weights at steps 2 and 3, a partial step 4 and run.json."""
    root = tmp_path / "runs"
    layout = RunLayout(str(root), RUN)
    sources = {step: _publish(layout, step, _perturbed(tiny_model_dir, seed=step)) for step in (2, 3)}
    partial = Path(layout.weights_dir("actor", 4))  # a crashed write: no marker, must never be exported
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    (Path(layout.run_dir) / "run.json").write_text(json.dumps(
        {"config": {"model": {"path": str(tiny_model_dir), "trust_remote_code": False}}, "started": "now"}))
    return root, sources


def _assert_loads_with(export: Path, expected: dict[str, torch.Tensor], tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export)
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name

    tokenizer = AutoTokenizer.from_pretrained(export)
    original = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "12+34=46 <|im_end|> é"
    ids = tokenizer(text)["input_ids"]
    assert ids == original(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == original.eos_token_id and tokenizer.pad_token_id == original.pad_token_id
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False) == "1+2="
    assert model.generation_config.eos_token_id == original.eos_token_id


def test_export_defaults_to_latest_committed_step(run_root, tiny_model_dir, capsys):
    root, sources = run_root
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", RUN, "--storage-root", str(root)])
    assert args.handler is cmd_export and args.step is None

    assert cmd_export(args) == 0
    export = Path(capsys.readouterr().out.strip())
    assert export == root / RUN / "export" / "step-3"  # 4 has no _COMMITTED marker
    names = {path.name for path in export.iterdir()}
    assert COMMITTED_MARKER not in names
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json",
            "tokenizer.json"} <= names
    assert not any(".tmp-" in path.name for path in export.parent.iterdir())
    info = json.loads((export / EXPORT_INFO).read_text())
    assert info["run"] == RUN and info["step"] == 3 and info["tokenizer"] == str(tiny_model_dir)
    _assert_loads_with(export, sources[3], tiny_model_dir)


def test_export_explicit_step_and_output(run_root, tiny_model_dir, tmp_path):
    root, sources = run_root
    output = tmp_path / "out" / "exp-step2"
    assert export_run(str(root), RUN, step=2, output=output) == output
    _assert_loads_with(output, sources[2], tiny_model_dir)
    # Exporting again replaces the earlier export in place.
    assert export_run(str(root), RUN, step=3, output=str(output)) == output
    _assert_loads_with(output, sources[3], tiny_model_dir)
    assert sorted(path.name for path in output.parent.iterdir()) == ["exp-step2"]


def test_a_local_export_links_the_weight_files_and_outlives_the_run_folders_copy(run_root, tiny_model_dir):
    """No second copy of the model on disk: the export's .safetensors is the weights folder's file (a hard link),
    the small files are its own, and deleting the run's weights (trainer.keep_weights does) leaves it whole."""
    import shutil

    root, sources = run_root
    export = export_run(str(root), RUN, step=3)
    weights = Path(RunLayout(str(root), RUN).weights_dir("actor", 3))
    assert (export / "model.safetensors").stat().st_ino == (weights / "model.safetensors").stat().st_ino
    assert (export / "config.json").stat().st_ino != (weights / "config.json").stat().st_ino
    shutil.rmtree(weights)
    _assert_loads_with(export, sources[3], tiny_model_dir)


def test_missing_step_lists_the_available_steps(run_root):
    root, _ = run_root
    with pytest.raises(ValueError, match=r"step 4 has no committed actor weights; available steps: 2, 3"):
        export_run(str(root), RUN, step=4)
    with pytest.raises(ValueError, match=r"step 7 .* available steps: 2, 3"):
        export_run(str(root), RUN, step=7)
    assert not (root / RUN / "export").exists()


def test_missing_run_json_needs_tokenizer_option(run_root, tiny_model_dir, tmp_path):
    root, sources = run_root
    (root / RUN / "run.json").unlink()
    with pytest.raises(ValueError, match=r"run\.json does not exist.*--tokenizer PATH"):
        export_run(str(root), RUN)
    assert not (root / RUN / "export").exists()  # nothing half-written
    export = export_run(str(root), RUN, tokenizer=str(tiny_model_dir))
    _assert_loads_with(export, sources[3], tiny_model_dir)


def test_refuses_to_replace_an_unrelated_folder_and_unknown_runs(run_root, tmp_path):
    root, _ = run_root
    unrelated = tmp_path / "precious"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not an earlier export"):
        export_run(str(root), RUN, output=unrelated)
    assert (unrelated / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="no run folder"):
        export_run(str(root), "nope")


def test_a_lora_run_exports_the_merged_model_and_its_adapter(tmp_path, tiny_model_dir):
    """model.lora_rank > 0: the published weights are merged (what transformers loads, with the adapted model's
    logits); the step's actor checkpoint gives `adapter/`, which peft puts back on the base."""
    import fsspec
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from components.actor import Actor, ActorConfig
    from components.batch import build_sequence_batch, model_logits
    from components.checkpoint import save_role_checkpoint
    from components.precision import save_compute_copy

    actor = Actor.from_pretrained(str(tiny_model_dir), ActorConfig(ppo_mini_batch_size=2, micro_batch_size=2,
                                                                   optim={"lr": 1e-2}),
                                  device="cpu", lora=dict(rank=4, alpha=16, dropout=0.0, target_modules="all-linear"))
    batch = build_sequence_batch([[1, 2], [3], [4, 5], [6]], [[7, 8], [9], [10], [11, 12]], 0)
    for _ in range(2):
        logprobs, _ = actor.compute_logprobs(batch)
        actor.update(batch, old_logprobs=logprobs, advantages=torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.5, 0.0],
                                                                             [-0.5, 1.0]]))
    layout = RunLayout(str(tmp_path / "runs"), RUN)
    with atomic_directory(layout.fs, layout.weights_dir("actor", 2)) as local:  # as the transport publishes it
        save_compute_copy(actor.policy_model, local, actor.policy_model.state_dict(), torch.float32)
    save_role_checkpoint(fsspec.filesystem("file"), f"{layout.checkpoint_dir(2)}/actor", actor.model, actor.updater)
    (Path(layout.run_dir) / "run.json").write_text(json.dumps(
        {"config": {"model": {"path": str(tiny_model_dir)}}, "started": "now"}))

    export = export_run(str(tmp_path / "runs"), RUN, output=tmp_path / "export")
    with torch.no_grad():
        expected = model_logits(actor.model.eval(), batch)
        merged = AutoModelForCausalLM.from_pretrained(export).eval()
        torch.testing.assert_close(model_logits(merged, batch), expected, rtol=0, atol=1e-5)
        assert sorted(p.name for p in (export / "adapter").iterdir()) == ["adapter_config.json",
                                                                          "adapter_model.safetensors"]
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), export / "adapter")
        torch.testing.assert_close(model_logits(adapted.eval(), batch), expected, rtol=0, atol=1e-5)
    assert json.loads((export / EXPORT_INFO).read_text())["adapter"].endswith("checkpoints/2/actor")
