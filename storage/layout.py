"""Where a run's files live on shared storage.

    <root>/<run_name>/
        steps/<step>/<stage>.parquet     per-step batch files (see schema.STAGES)
        weights/<role>/<step>/           published model weights (+ _COMMITTED)
        checkpoints/<step>/              resumable training state
        data/                            prepared prompt files
        artifacts/                       metrics, reports, samples

`root` is a local path or any fsspec URI (memory://, file://, s3://...). All
paths returned here are in the filesystem's own spelling (no protocol), ready
to pass to `layout.fs`.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import fsspec

from storage.schema import get_stage

COMMITTED_MARKER = "_COMMITTED"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class LayoutError(ValueError):
    """A run name, role, stage or step that cannot be mapped to a path."""


def _check_path_component(value: str, field: str) -> str:
    # Names become directory names, so anything that could escape the run
    # directory ("/", "..") or needs quoting on object stores is rejected.
    if not isinstance(value, str) or not _SAFE_NAME.match(value) or set(value) == {"."}:
        raise LayoutError(
            f"{field}={value!r} is invalid: use a non-empty name of letters, digits, "
            "'.', '_' or '-' (and not only dots)"
        )
    return value


def local_write_problem(path: str | os.PathLike) -> str | None:
    """Why a folder could not be created or written at the local `path` (None: it can): the nearest existing
    folder above it is probed by creating and removing a temporary folder there, so nothing is left behind."""
    target = Path(path).expanduser().absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlhf-write-check-", dir=existing))
    except OSError as error:
        return f"cannot create a folder in {str(existing)!r} ({error.strerror or type(error).__name__})"
    return None


def check_storage_root(root: str, field: str = "run.storage_root") -> None:
    """A local storage root (a path or file:// URI) must be creatable and writable: LayoutError naming `field`
    otherwise. Other fsspec URIs (s3://, memory://) are left to their filesystem."""
    fs, path = fsspec.core.url_to_fs(root)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if not {"file", "local"} & set(protocols):
        return
    problem = local_write_problem(path)
    if problem:
        raise LayoutError(f"{field}={root!r} is not writable: {problem}; give a folder you can write (a local "
                          "path or an fsspec URI)")


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise LayoutError(f"step={step!r} is invalid: expected an integer >= 0")
    return step


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/")] + [str(part) for part in parts])


class RunLayout:
    def __init__(self, root: str, run_name: str):
        self.run_name = _check_path_component(run_name, "run.name")
        self.root = root
        self.fs, root_path = fsspec.core.url_to_fs(root)
        self.root_path = root_path

    def __repr__(self) -> str:
        return f"RunLayout(root={self.root!r}, run_name={self.run_name!r})"

    @property
    def run_dir(self) -> str:
        return _join(self.root_path, self.run_name)

    @property
    def data_dir(self) -> str:
        return _join(self.run_dir, "data")

    @property
    def artifacts_dir(self) -> str:
        return _join(self.run_dir, "artifacts")

    def step_dir(self, step: int) -> str:
        return _join(self.run_dir, "steps", _check_step(step))

    def stage_path(self, step: int, stage: str) -> str:
        get_stage(stage)
        return _join(self.step_dir(step), f"{stage}.parquet")

    def weights_dir(self, role: str, step: int) -> str:
        role = _check_path_component(role, "role")
        return _join(self.run_dir, "weights", role, _check_step(step))

    def checkpoint_dir(self, step: int) -> str:
        return _join(self.run_dir, "checkpoints", _check_step(step))

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def committed_stages(self, step: int) -> set[str]:
        """Stages whose final file exists for `step` (temp files are ignored).

        Existence only; use io.validate_stage_file to also check content.
        """
        step_dir = self.step_dir(step)
        if not self.fs.exists(step_dir):
            return set()
        stages = set()
        for entry in self.fs.ls(step_dir, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            stem, dot, extension = name.rpartition(".")
            if dot and extension == "parquet" and _is_stage(stem):
                stages.add(stem)
        return stages

    def step_folders(self, parent: str) -> list[int]:
        """The steps named by `parent`'s subfolders (canonical spellings only: 0, 1, 12, ...), sorted."""
        if not self.fs.exists(parent):
            return []
        steps = []
        for entry in self.fs.ls(parent, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if re.fullmatch(r"0|[1-9][0-9]*", name):
                steps.append(int(name))
        return sorted(steps)

    def latest_weights(self, role: str) -> tuple[int, str] | None:
        """Highest step whose weights dir for `role` carries the commit marker.

        Directories without the marker are partial uploads (or crashed
        writes) and must never be loaded.
        """
        # Only canonical spellings, so weights_dir(role, step) maps back to it.
        steps = self.step_folders(_join(self.run_dir, "weights", _check_path_component(role, "role")))
        for step in reversed(steps):
            path = self.weights_dir(role, step)
            if self.fs.exists(_join(path, COMMITTED_MARKER)):
                return step, path
        return None


def _is_stage(name: str) -> bool:
    try:
        get_stage(name)
    except ValueError:
        return False
    return True
