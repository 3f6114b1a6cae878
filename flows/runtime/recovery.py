"""Recovery, in one place: the run record, checkpoints, finished stages, and which training state a
trained role restores.

Files, all under the run folder and all written atomically:
    run.json                        the config, the MLflow run id and the lineage (the data files the run
                                    read, the run and step model.from_run started from), when the run starts
    checkpoints/<k>/actor|critic/   role state at the start of step k (components/checkpoint.py)
    checkpoints/<k>/driver.json     the KL controller at the start of step k
    checkpoints/latest.json         {"step": k}, written after every part of checkpoint k
    steps/<k>/<stage>.metrics.json  the metrics a finished stage returned, written after its output

A stage declared skippable (flows/training/registry.py) is finished when its output validates (its batch
reads back whole through the run's Batches, flows/runtime/batches.py; or its weights are committed) and its
metrics file exists; a resumed run does not run it again. Updates are never skipped: they restart from the
restored checkpoint and rewrite their outputs identically.

A trained role (actor, critic) holds the training state at the start of some step; a stage at step k
needs step k's. `restore_point` says where a role built now starts (the latest checkpoint: where a
resumed run restarts, and where a worker that replaces a dead one picks up); `state_source` says where
a resident role holding another state gets step k's, or raises RoleStateError saying what to do.
"""

from __future__ import annotations

from flows.runtime.batches import Batches, StorageBatches
from storage import COMMITTED_MARKER, RunLayout, read_json, write_json_atomic
from storage.io import StorageFileError

LATEST = object()
"""The `restore` of a trained role's builder by default: the run's latest checkpoint, if any."""


class RoleStateError(RuntimeError):
    """A trained role's state is not the one the stage needs, and no checkpoint has it."""


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
    """Record the driver's part, point `latest` at step k, then delete all but the newest `keep` up to k (a
    later one may be in the writing)."""
    write_json_atomic(layout.fs, _driver_path(layout, step), driver_state)
    write_json_atomic(layout.fs, f"{layout.run_dir}/checkpoints/latest.json", {"step": step})
    for old in [folder for folder in layout.step_folders(f"{layout.run_dir}/checkpoints") if folder <= step][:-keep]:
        layout.fs.rm(layout.checkpoint_dir(old), recursive=True)


def driver_state(layout: RunLayout, step: int) -> dict:
    return read_json(layout.fs, _driver_path(layout, step))


def restore_point(layout: RunLayout, role: str, restore: int | None | object = LATEST) -> tuple[int | None, str | None]:
    """(checkpoint step, the role's folder in it) to build a trained role from; (None, None): the initial
    weights. `restore`: a checkpoint step, None for the initial weights, or LATEST: the run's latest
    checkpoint (a new run's folder holds none: start_run refuses or clears an existing one)."""
    step = latest_checkpoint(layout) if restore is LATEST else restore
    return step, None if step is None else f"{layout.checkpoint_dir(step)}/{role}"


def state_source(layout: RunLayout, role: str, step: int, held: int | None, stage: str) -> int | None:
    """Where a trained role holding the state of step `held` (None: unknown, an update stopped midway)
    gets the state at the start of `step`: the checkpoint of `step`, or None for the initial weights
    (step 0). Raises RoleStateError, with what to do, when neither has it."""
    if checkpoint_committed(layout, step):
        return step
    if step == 0:
        return None
    latest = latest_checkpoint(layout)
    state = "no known step (an update stopped midway)" if held is None else f"step {held}"
    raise RoleStateError(
        f"stage {stage} at step {step}: the {role} holds the training state of {state} and no checkpoint has "
        f"step {step}'s (its worker was replaced, or an attempt of the stage stopped midway); resume the run: "
        f"rlhf resume {layout.run_name} (restarts at {'the start' if latest is None else f'step {latest}'})")


def _metrics_path(layout: RunLayout, stage: str, step: int | None) -> str:
    if step is None:
        return f"{layout.run_dir}/{stage}.metrics.json"
    return f"{layout.step_dir(step)}/{stage}.metrics.json"


def record_stage_metrics(layout: RunLayout, stage, step: int | None, metrics: dict) -> None:
    """Keep a skippable stage's metrics beside its output (`stage`: its registry declaration)."""
    if stage.skippable:
        write_json_atomic(layout.fs, _metrics_path(layout, stage.name, step), metrics)


def _output_written(layout: RunLayout, batches: Batches, stage, step: int | None, expected_rows: int | None) -> bool:
    if stage.output.startswith("weights/"):  # the warm-start's policy: weights/<role>/0
        return layout.fs.exists(f"{layout.weights_dir(stage.output.split('/')[1], step or 0)}/{COMMITTED_MARKER}")
    return batches.readable(step, stage.output, expected_rows=expected_rows if stage.per_sample else None)


def finished_stage_metrics(layout: RunLayout, stage, step: int | None, expected_rows: int | None,
                           batches: Batches | None = None) -> dict | None:
    """The stored metrics of a finished stage (`stage`: its registry declaration), or None when it must
    run (not skippable; output or metrics missing, partial or corrupt). `batches`: the run's
    (flows/runtime/batches.py: batches_for), its folder's Parquet files when not given."""
    if not stage.skippable:
        return None
    batches = StorageBatches(layout) if batches is None else batches
    metrics_path = _metrics_path(layout, stage.name, step)
    if not layout.fs.exists(metrics_path) or not _output_written(layout, batches, stage, step, expected_rows):
        return None
    try:
        return read_json(layout.fs, metrics_path)
    except StorageFileError:
        return None


def _role_checkpoint_whole(layout: RunLayout, step: int) -> bool:
    """Every role folder of checkpoint `step` is committed and its driver part is written."""
    if not checkpoint_committed(layout, step):
        return False
    directory = layout.checkpoint_dir(step)
    roles = [entry for entry in layout.fs.ls(directory, detail=True) if entry["type"] == "directory"]
    return all(layout.fs.exists(f"{entry['name'].rstrip('/')}/{COMMITTED_MARKER}") for entry in roles)


def repair_latest_pointer(layout: RunLayout) -> str | None:
    """A missing or unreadable checkpoints/latest.json, or one naming a checkpoint that is not whole, is
    rewritten to the newest whole checkpoint; returns a line saying so (None when nothing changed)."""
    path = f"{layout.run_dir}/checkpoints/latest.json"
    try:
        pointed = latest_checkpoint(layout)
    except (StorageFileError, KeyError, ValueError, TypeError):
        pointed = "unreadable"
    if isinstance(pointed, int) and _role_checkpoint_whole(layout, pointed):
        return None
    whole = [step for step in layout.step_folders(f"{layout.run_dir}/checkpoints") if _role_checkpoint_whole(layout, step)]
    if not whole:
        if pointed is None:
            return None
        layout.fs.rm(path)
        return f"checkpoints/latest.json named checkpoint {pointed}, which is not whole, and no whole checkpoint exists: the run restarts at step 0"
    write_json_atomic(layout.fs, path, {"step": whole[-1]})
    what = "was missing" if pointed is None else f"named checkpoint {pointed}, which is not whole"
    return f"checkpoints/latest.json {what}: rebuilt from the newest whole checkpoint, step {whole[-1]}"


def check_step_files(layout: RunLayout, start_step: int, batches: Batches | None = None) -> list[str]:
    """Validate every committed batch of every step (footer, schema; a partial or corrupt file fails).
    A bad batch of a step the resume reruns (>= start_step) is removed with its metrics, so the stage runs
    again; one of an earlier step, which nothing reruns, is moved aside to `<file>.corrupt`. One line each.
    `batches`: the run's (flows/runtime/batches.py), its folder's Parquet files when not given."""
    batches = StorageBatches(layout) if batches is None else batches
    lines = []
    for step in layout.step_folders(f"{layout.run_dir}/steps"):
        for stage in sorted(batches.committed_stages(step)):
            if batches.readable(step, stage):
                continue
            metrics = f"{layout.step_dir(step)}/{stage}.metrics.json"
            if step >= start_step:
                batches.discard(step, stage)
                if layout.fs.exists(metrics):
                    layout.fs.rm(metrics)
                lines.append(f"steps/{step}/{stage}.parquet is corrupt or partial: removed, the stage runs again")
            else:
                batches.discard(step, stage, keep_aside=True)
                lines.append(f"steps/{step}/{stage}.parquet is corrupt or partial: step {step} is before checkpoint "
                             f"{start_step}, where the run resumes, so nothing reruns it; moved to {stage}.parquet.corrupt")
    return lines


IGNORED_ON_RESUME = ("run.resume", "run.overwrite")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def record_resume_changes(layout: RunLayout, config_record: dict, when: str) -> tuple[dict, int]:
    """Keep what a resume changed (its overrides, e.g. model.path or trainer.total_steps): run.json's config
    becomes the resumed one, so every later stage, resume and the export read it, and `resumes` lists each
    resume's changes as {key: [before, after]}. Returns the changes (empty when none) and how many resumes
    changed something, this one included."""
    record = read_run_record(layout)
    before, after = _flatten(record["config"]), _flatten(config_record)
    changes = {key: [before.get(key), after.get(key)] for key in sorted(set(before) | set(after))
               if before.get(key) != after.get(key) and key not in IGNORED_ON_RESUME}
    if changes:
        kept = {key.split(".")[1]: record["config"]["run"].get(key.split(".")[1]) for key in IGNORED_ON_RESUME}
        record["config"] = config_record
        record["config"]["run"].update(kept)
        record["resumes"] = [*record.get("resumes", []), {"at": when, "changed": changes}]
        write_run_record(layout, record)
    return changes, len(record.get("resumes", []))
