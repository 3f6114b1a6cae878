"""A trained role's part of a checkpoint, written now or in the background (trainer.checkpoint_async).

In the background, the checkpoint stage only copies the role's training state (weights, AdamW state,
schedule, RNG) into host memory and returns; a thread of the role's process writes it and commits it
atomically (components/checkpoint.py) while the run goes on to the next step's rollout, scoring and
log-probs. From its start to its commit the part is claimed (`checkpoints/<k>/<role>.writer.json`: host,
pid, and the error if writing failed). The driver commits checkpoint k (its own part and `latest.json`,
flows/runtime/recovery.py) once every role's part is committed, and waits for that before the next
update changes the roles (`wait_written`), so that an update that fails midway, or a replaced worker,
still finds checkpoint k; a run that stops waits for it too. The run's last checkpoint is written
at once: nothing is left to overlap it with.

One part per role is in flight in a process at a time; a process that ends finishes its parts first.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future

from components.checkpoint import role_state, write_role_state
from flows.config import Config, layout_for
from flows.runtime.console import long_work
from flows.runtime.weights import transport_for
from flows.runtime.weights.stored_copy import claim, release, writer_gone
from storage import COMMITTED_MARKER, RunLayout, write_bytes_atomic

CHECKPOINT_QUIET_S = 5.0
"""A role's checkpoint that ends sooner prints no progress line (a tiny model's, every step)."""

_WRITING: dict[str, Future] = {}
"""Role folder of a checkpoint -> its writing in this process (one per role: keyed by the run and role)."""
_WRITING_LOCK = threading.Lock()
_HOST_BUFFERS: dict[str, dict] = {}
"""Role -> the page-locked host memory its last part was copied into (GPU roles), reused by its next part once
that one is written: the copy is then one fast device-to-host pass, with no memory to allocate and pin."""


def in_background(config: Config, step: int) -> bool:
    """Whether checkpoint `step` is written in the background (every one but the run's last)."""
    return config.trainer.checkpoint_async and step < config.trainer.total_steps


def part_path(layout: RunLayout, step: int, role: str) -> str:
    return f"{layout.checkpoint_dir(step)}/{role}"


def _claim_path(layout: RunLayout, step: int, role: str) -> str:
    return f"{part_path(layout, step, role)}.writer.json"


def save_role_part(config: Config, step: int, role: str, instance) -> dict[str, float]:
    """Checkpoint `step`'s part of a trained role (its resident `instance`); returns timing metrics."""
    layout = layout_for(config)
    key = f"{layout.run_dir}/{role}"
    with _WRITING_LOCK:  # the part before (of any run in this process), if still being written: its host memory
        before = [other for other in _WRITING if other.rsplit("/", 1)[-1] == role]  # is reused below
    for other in before:
        finish_writing(other, raises=False)  # (its failure is the driver's to say)
    path = part_path(layout, step, role)
    tokenizer = getattr(instance, "tokenizer", None) if role == "actor" else None
    transport = transport_for(config) if role == "actor" else None
    metrics: dict[str, float] = {}
    started = time.perf_counter()
    if not in_background(config, step):
        _HOST_BUFFERS.pop(role, None)  # the run's last part: the host memory is let go
        what = f"checkpoint at step {step}: writing the {role}'s weights and optimizer state"
        with long_work(what, f"{what}: {{seconds:.0f}} s so far", f"checkpoint at step {step}: {role} written in "
                       "{seconds:.1f} s", announce_after_s=CHECKPOINT_QUIET_S):
            if transport is not None:  # the copy of this step's policy a resumed rollout reloads comes first
                transport.flush()
            state = role_state(instance.model, instance.updater, tokenizer)
            if state is not None:
                try:
                    write_role_state(layout.fs, path, state)
                except (OSError, RuntimeError) as error:  # torch.save says only "unexpected pos" on a full disk
                    raise RuntimeError(f"checkpoint at step {step}: writing the {role}'s part failed: "
                                       f"{_why(layout.fs, path, state, error)}") from error
        metrics[f"timing_s/checkpoint_{role}"] = time.perf_counter() - started
        return metrics
    state = role_state(instance.model, instance.updater, tokenizer, host_copy=True,
                       host_buffers=_HOST_BUFFERS.setdefault(role, {}))  # free again: the part before is written
    metrics[f"timing_s/checkpoint_{role}"] = time.perf_counter() - started
    if state is None:  # a sharded role's other ranks: rank 0 writes
        return metrics
    metrics[f"checkpoint/{role}_host_gib"] = state.nbytes() / 2**30
    claim_path = _claim_path(layout, step, role)
    claim(layout.fs, claim_path)

    def write() -> None:
        try:
            if transport is not None:
                transport.flush()
            write_role_state(layout.fs, path, state)
        except BaseException as error:  # noqa: BLE001 - the driver reads it from the claim
            _failed(layout.fs, claim_path, _why(layout.fs, path, state, error))
            raise
        release(layout.fs, claim_path)

    _start(key, write, f"rlhf-checkpoint-{role}-{step}")
    return metrics


def _why(fs, path: str, state, error: BaseException) -> str:
    """The error, with the free space where the part goes against its size (on a local disk)."""
    why = f"{type(error).__name__}: {error}"
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return why
    folder = os.path.dirname(path)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        free = shutil.disk_usage(folder or ".").free
    except OSError:
        return why
    return f"{why} ({free / 2**30:.1f} GiB free on the disk of {folder}; the part holds {state.nbytes() / 2**30:.1f} GiB)"


def _failed(fs, claim_path: str, why: str) -> None:
    """Say in the claim why the part will not be committed. On a full disk the claim itself may not be
    rewritable: it is removed first (which frees its room) and written again; failing that too, no claim is
    left, so the waiting driver is told that nobody writes the part (stored_copy.writer_gone) instead of
    waiting for ever on a writer that is alive but done."""
    payload = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "error": why}).encode()
    for attempt in range(2):
        try:
            write_bytes_atomic(fs, claim_path, payload)
            return
        except OSError:
            if attempt == 0:
                release(fs, claim_path)


def _start(key: str, write, name: str) -> None:
    done: Future = Future()

    def run() -> None:
        try:
            write()
        except BaseException as error:  # noqa: BLE001 - raised where the part is waited for
            done.set_exception(error)
        else:
            done.set_result(None)

    with _WRITING_LOCK:
        _WRITING[key] = done
    threading.Thread(target=run, name=name, daemon=True).start()


def finish_writing(key: str, raises: bool = True) -> None:
    """Wait for the part this process writes under `key` (run folder/role), if any; raises its error."""
    with _WRITING_LOCK:
        done = _WRITING.pop(key, None)
    if done is not None and (raises or done.exception() is None):
        done.result()


@atexit.register
def _finish_all() -> None:
    """A process that ends (a worker stopped) finishes the parts it was writing first (a failed one's claim
    says why it is not committed)."""
    with _WRITING_LOCK:
        keys = list(_WRITING)
    for key in keys:
        finish_writing(key, raises=False)


def wait_written(layout: RunLayout, step: int, role: str, poll_s: float = 0.05) -> str | None:
    """Wait until the role's part of checkpoint `step` is committed (None), or say why it will not be: its
    writing failed, or the process writing it ended."""
    marker = f"{part_path(layout, step, role)}/{COMMITTED_MARKER}"
    claim_path, started = _claim_path(layout, step, role), time.monotonic()
    while not layout.fs.exists(marker):
        why = writer_gone(layout.fs, claim_path, time.monotonic() - started)
        if why is not None:
            return None if layout.fs.exists(marker) else why  # committed between the two looks
        time.sleep(poll_s)
    return None
