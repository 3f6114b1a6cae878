"""What a resumed run needs to know: the run record, the latest checkpoint, finished stages.

Files, all under the run folder and all written atomically:
    run.json                        the config and the MLflow run id (written when the run starts)
    checkpoints/<k>/actor|critic/   role state at the start of step k (components/checkpoint.py)
    checkpoints/<k>/driver.json     the KL controller at the start of step k
    checkpoints/latest.json         {"step": k}, written after every part of checkpoint k
    steps/<k>/<stage>.metrics.json  the metrics a finished stage returned, written after its output

A stage is finished when its output validates (storage.validate_stage_file) and its metrics file
exists; a resumed run does not run it again. Updates are never skipped: they restart from the
restored checkpoint and rewrite their outputs identically.
"""

from __future__ import annotations

from storage import RunLayout, read_json, validate_stage_file, write_json_atomic
from storage.io import StorageFileError

SKIPPABLE_STAGES = frozenset({"rollout", "reward", "reference", "values", "old_logprobs", "advantages",
                              "validate", "warm_start"})
STAGE_FILES = {"validate": "validation"}  # stage task name -> its output file's stage name


def run_record_path(layout: RunLayout) -> str:
    return f"{layout.run_dir}/run.json"


def write_run_record(layout: RunLayout, record: dict) -> None:
    write_json_atomic(layout.fs, run_record_path(layout), record)


def read_run_record(layout: RunLayout) -> dict:
    path = run_record_path(layout)
    if not layout.fs.exists(path):
        raise ValueError(f"run {layout.run_name!r}: no {path}; nothing to resume (is run.storage_root right?)")
    return read_json(layout.fs, path)


def latest_checkpoint(layout: RunLayout) -> int | None:
    path = f"{layout.run_dir}/checkpoints/latest.json"
    if not layout.fs.exists(path):
        return None
    return int(read_json(layout.fs, path)["step"])


def prune_weights(layout: RunLayout, newest: int, keep: int | None) -> list[int]:
    """Delete the actor's published weights older than the newest `keep` (counted back from `newest`),
    except step 0 and the steps that still have a checkpoint (a resume reloads the rollout from them).
    Returns the deleted steps."""
    if keep is None:
        return []
    protected = {0, *layout.step_folders(f"{layout.run_dir}/checkpoints")}
    deleted = []
    for step in layout.step_folders(f"{layout.run_dir}/weights/actor"):
        if step <= newest - keep and step not in protected:
            layout.fs.rm(layout.weights_dir("actor", step), recursive=True)
            deleted.append(step)
    return deleted


def _driver_path(layout: RunLayout, step: int) -> str:
    return f"{layout.checkpoint_dir(step)}/driver.json"


def checkpoint_committed(layout: RunLayout, step: int) -> bool:
    """Whether checkpoint `step` is whole: the driver's part is written last, after the roles'."""
    return layout.fs.exists(_driver_path(layout, step))


def commit_checkpoint(layout: RunLayout, step: int, driver_state: dict, keep: int) -> None:
    """Record the driver's part, point `latest` at step k, then delete all but the newest `keep`."""
    write_json_atomic(layout.fs, _driver_path(layout, step), driver_state)
    write_json_atomic(layout.fs, f"{layout.run_dir}/checkpoints/latest.json", {"step": step})
    for old in layout.step_folders(f"{layout.run_dir}/checkpoints")[:-keep]:
        layout.fs.rm(layout.checkpoint_dir(old), recursive=True)


def driver_state(layout: RunLayout, step: int) -> dict:
    return read_json(layout.fs, _driver_path(layout, step))


def _metrics_path(layout: RunLayout, stage: str, step: int | None) -> str:
    if step is None:
        return f"{layout.run_dir}/{stage}.metrics.json"
    return f"{layout.step_dir(step)}/{stage}.metrics.json"


def record_stage_metrics(layout: RunLayout, stage: str, step: int | None, metrics: dict) -> None:
    if stage in SKIPPABLE_STAGES:
        write_json_atomic(layout.fs, _metrics_path(layout, stage, step), metrics)


def finished_stage_metrics(layout: RunLayout, stage: str, step: int | None, expected_rows: int | None) -> dict | None:
    """The stored metrics of a finished stage, or None when it must run (missing, partial, corrupt)."""
    if stage not in SKIPPABLE_STAGES:
        return None
    metrics_path = _metrics_path(layout, stage, step)
    if not layout.fs.exists(metrics_path):
        return None
    if stage == "warm_start":
        committed = f"{layout.weights_dir('actor', 0)}/_COMMITTED"
        if not layout.fs.exists(committed):
            return None
    else:
        rows = None if stage == "validate" else expected_rows
        if not validate_stage_file(layout, step, STAGE_FILES.get(stage, stage), expected_rows=rows):
            return None
    try:
        return read_json(layout.fs, metrics_path)
    except StorageFileError:
        return None
