"""`rlhf export`: a trained policy as a self-contained Hugging Face folder.

    rlhf export exp1                       # the latest committed actor weights of run exp1
    rlhf export exp1 40 --output models/exp1-step40

The run's actor weights live under `weights/actor/<k>/` (safetensors + config.json +
generation_config.json from `save_pretrained`, plus the `_COMMITTED` marker). Only the warm-start
output (`weights/actor/0`) carries tokenizer files, so the tokenizer comes from the run's config
(`<run_dir>/run.json`: `config.model.path`), or from `--tokenizer PATH`. The result loads as is with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` and with vLLM
(`vllm serve DIR`). A LoRA run's weights are published merged; its adapter (the step's actor checkpoint)
is copied beside them as `adapter/` when that step has a checkpoint.

The export is built in a temporary sibling and renamed into place, so a folder under the final name
is always complete. It also holds `rlhf_export.json` (run, step, sources); an existing output folder
is replaced only when it is an earlier export (or empty), never an unrelated folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
from transformers import AutoConfig, GenerationConfig

from components.models import load_tokenizer
from storage.io import read_json
from storage.layout import COMMITTED_MARKER, RunLayout

DEFAULT_STORAGE_ROOT = ".rlhf/runs"
RUN_FILE = "run.json"
EXPORT_INFO = "rlhf_export.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model")
ADAPTER_FOLDER = "adapter"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""A LoRA run's actor checkpoint (a peft folder); the export copies it as `adapter/` beside the merged model."""


def _join(base: str, *parts) -> str:
    return "/".join([base.rstrip("/"), *(str(part) for part in parts)])


def committed_steps(layout: RunLayout, role: str = "actor") -> list[int]:
    """Steps whose `weights/<role>/<k>` folder carries the commit marker, ascending."""
    role_dir = _join(layout.run_dir, "weights", role)
    if not layout.fs.exists(role_dir):
        return []
    steps = []
    for entry in layout.fs.ls(role_dir, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if re.fullmatch(r"0|[1-9][0-9]*", name) and layout.fs.exists(_join(role_dir, name, COMMITTED_MARKER)):
            steps.append(int(name))
    return sorted(steps)


def _choose_step(layout: RunLayout, step: int | None) -> int:
    steps = committed_steps(layout)
    if not steps:
        raise ValueError(f"run {layout.run_name!r}: no committed actor weights under "
                         f"{_join(layout.run_dir, 'weights', 'actor')} (has the run finished a step?)")
    if step is None:
        latest = layout.latest_weights("actor")
        return latest[0] if latest else steps[-1]
    if step not in steps:
        raise ValueError(f"run {layout.run_name!r}: step {step} has no committed actor weights; "
                         f"available steps: {', '.join(map(str, steps))}")
    return step


def _read_run_config(layout: RunLayout) -> dict | None:
    """The run's config from `<run_dir>/run.json`, or None when the run did not write one."""
    path = _join(layout.run_dir, RUN_FILE)
    if not layout.fs.exists(path):
        return None
    content = read_json(layout.fs, path)
    config = content.get("config") if isinstance(content, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object with a 'config' object")
    return config


def _tokenizer_candidates(layout: RunLayout, step: int,
                          tokenizer: str | None) -> tuple[list[tuple[str, str | None]], bool]:
    """[(what, path or hub name)] to load the tokenizer from, in order (None: the exported weights
    folder itself); and trust_remote_code. Checked before anything is written."""
    config = _read_run_config(layout)
    model = (config or {}).get("model") or {}
    trust_remote_code = bool(model.get("trust_remote_code", False))
    if tokenizer:  # explicit: only this one, so a mistake is not papered over
        return [("--tokenizer", tokenizer)], trust_remote_code
    candidates = []
    if model.get("path"):
        candidates.append((f"model.path in {_join(layout.run_dir, RUN_FILE)}", str(model["path"])))
    weights = layout.weights_dir("actor", step)
    if any(layout.fs.exists(_join(weights, name)) for name in TOKENIZER_FILES):  # the warm-start output
        candidates.append(("the weights folder", None))
    if not candidates:
        where = (f"{_join(layout.run_dir, RUN_FILE)} has no config.model.path" if config is not None
                 else f"{_join(layout.run_dir, RUN_FILE)} does not exist (a run from before run.json)")
        raise ValueError(f"run {layout.run_name!r}: cannot tell which tokenizer the run used: {where}, and the "
                         "weights folder has no tokenizer files; pass --tokenizer PATH (the run's model.path)")
    return candidates, trust_remote_code


def _load_run_tokenizer(candidates, trust_remote_code: bool, local_weights: Path):
    """(tokenizer, its source): the first candidate that loads; ValueError naming each failure."""
    failures = []
    for what, source in candidates:
        source = str(local_weights) if source is None else source
        try:
            return load_tokenizer(source, trust_remote_code), source
        except (OSError, ValueError) as error:
            failures.append(f"{what} {source!r}: {str(error).splitlines()[0]}")
    explicit = candidates[0][0] == "--tokenizer"
    raise ValueError("the tokenizer could not be loaded (" + "; ".join(failures) + ")" + (
        "" if explicit else "; pass --tokenizer PATH with the run's model.path (a relative model.path "
                            "resolves against the current folder)"))


def _copy_weights(fs, source: str, target: Path) -> None:
    """Every file of the weights folder except the commit marker (the export is not a run folder). The weight
    files (.safetensors) of a local run folder are hard-linked when the export is on the same file system: a
    committed weights folder is never written again (a new step is a new folder), so the export costs no second
    copy of the model on disk, and deleting the run's old weights (trainer.keep_weights) leaves it whole."""
    source = source.rstrip("/")
    for remote in fs.find(source):
        relative = remote[len(source):].lstrip("/")
        if not relative or relative.rsplit("/", 1)[-1] == COMMITTED_MARKER:
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(fs, LocalFileSystem) and relative.endswith(".safetensors"):
            with contextlib.suppress(OSError):  # another file system (EXDEV), or links not allowed: copy
                os.link(fs._strip_protocol(remote), destination)
                continue
        fs.get_file(remote, str(destination))


def _ensure_generation_config(folder: Path, tokenizer_source: str) -> None:
    """save_pretrained writes generation_config.json for causal LMs; make one if it is missing."""
    if (folder / "generation_config.json").exists():
        return

    try:
        generation = GenerationConfig.from_pretrained(tokenizer_source)
    except (OSError, ValueError):
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
    generation.save_pretrained(folder)


def _copy_adapter(layout: RunLayout, step: int, staging: Path) -> str | None:
    """A LoRA run (model.lora_rank > 0): the adapter of the step's actor checkpoint as `adapter/` (the published
    weights are already merged); its adapter_config.json names the base it applies to (the run's initial
    policy). Returns the checkpoint folder's URI, or None when the step has no adapter checkpoint."""
    checkpoint = _join(layout.checkpoint_dir(step), "actor")
    if not all(layout.fs.exists(_join(checkpoint, name)) for name in (*ADAPTER_FILES, COMMITTED_MARKER)):
        return None
    (staging / ADAPTER_FOLDER).mkdir()
    for name in ADAPTER_FILES:
        layout.fs.get_file(_join(checkpoint, name), str(staging / ADAPTER_FOLDER / name))
    return layout.fs.unstrip_protocol(checkpoint)


def _build(layout: RunLayout, step: int, staging: Path, tokenizer: tuple[list, bool]) -> None:
    weights = layout.weights_dir("actor", step)
    _copy_weights(layout.fs, weights, staging)
    adapter = _copy_adapter(layout, step, staging)
    if not (staging / "config.json").exists():
        raise ValueError(f"{weights}: no config.json; not a save_pretrained folder")
    loaded, source = _load_run_tokenizer(*tokenizer, staging)
    loaded.save_pretrained(staging)
    _ensure_generation_config(staging, source)
    weights_uri = layout.fs.unstrip_protocol(weights)
    info = {"run": layout.run_name, "step": step, "weights": weights_uri,
            "tokenizer": weights_uri if source == str(staging) else source, "storage_root": layout.root}
    if adapter is not None:
        info["adapter"] = adapter
    (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _check_replaceable(fs, path: str) -> None:
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise ValueError(f"--output {path} exists and is a file; choose another --output")
    if fs.ls(path, detail=False) and not fs.exists(_join(path, EXPORT_INFO)):
        raise ValueError(f"--output {path} exists and is not an earlier export (no {EXPORT_INFO}); "
                         "choose another --output or remove it")


def export_run(storage_root: str, run_name: str, step: int | None = None, output: str | os.PathLike | None = None,
               tokenizer: str | None = None) -> Path | str:
    """Write the actor weights of `run_name` at `step` (default: latest committed) as an HF folder.

    Returns the output folder: a Path when it is local, else its fsspec URI. Raises ValueError (one
    line, naming what to change) for a missing run, step or tokenizer.
    """
    layout = RunLayout(storage_root, run_name)
    if not layout.exists(layout.run_dir):
        raise ValueError(f"run {run_name!r}: no run folder at {layout.fs.unstrip_protocol(layout.run_dir)} "
                         "(check the run name and --storage-root)")
    step = _choose_step(layout, step)
    tokenizer_sources = _tokenizer_candidates(layout, step, tokenizer)
    if output is None:
        out_fs, out_path = layout.fs, _join(layout.run_dir, "export", f"step-{step}")
    else:
        output = str(output) if "://" in str(output) else os.path.expanduser(str(output))
        out_fs, out_path = fsspec.core.url_to_fs(output)
    out_path = out_path.rstrip("/")
    _check_replaceable(out_fs, out_path)

    if isinstance(out_fs, LocalFileSystem):
        out_path = os.path.abspath(out_fs._strip_protocol(out_path))
        parent = os.path.dirname(out_path)
        created_parent = not os.path.exists(parent)
        os.makedirs(parent, exist_ok=True)
        staging = f"{out_path}.tmp-{uuid.uuid4().hex}"  # same filesystem: the rename is atomic
        os.makedirs(staging)
        try:
            _build(layout, step, Path(staging), tokenizer_sources)
            if os.path.exists(out_path):  # an earlier export: move it aside, then swap
                old = f"{out_path}.old-{uuid.uuid4().hex}"
                os.replace(out_path, old)
                os.replace(staging, out_path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, out_path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if created_parent:
                with contextlib.suppress(OSError):
                    os.rmdir(parent)  # the folder made here, when still empty
            raise
        return Path(out_path)

    with tempfile.TemporaryDirectory(prefix="rlhf-export-") as local:
        _build(layout, step, Path(local), tokenizer_sources)
        temporary = f"{out_path}.tmp-{uuid.uuid4().hex}"
        try:
            out_fs.put(local, temporary, recursive=True)
            if out_fs.exists(out_path):
                out_fs.rm(out_path, recursive=True)
            out_fs.mv(temporary, out_path, recursive=True)
        finally:
            with contextlib.suppress(Exception):
                if out_fs.exists(temporary):
                    out_fs.rm(temporary, recursive=True)
    return out_fs.unstrip_protocol(out_path)
