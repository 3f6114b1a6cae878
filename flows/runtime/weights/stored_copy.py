"""A stored copy of a published policy, made in the background (MemoryTransport, in_memory.py,
and StreamTransport): one per run folder at a time, on a thread of its own. First the snapshot (the
compute-dtype tensors to the host), once the version has reached the rollout (`copy_due`) or after
HANDOVER_FIRST_S; then the writing and the atomic commit. A checkpoint, the export and the next update ask
for it at once (`copy_due`); a process that ends finishes its copies first. From its start to its commit the
copy is claimed (`claim`: `weights/actor/<k>.writer.json`, host and pid), so that a reader in another process
waits for it only while its writer lives (`writer_gone`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
from concurrent.futures import Future
from typing import Any, Callable

from flows.runtime.supervision import pid_alive
from storage import write_bytes_atomic

HANDOVER_FIRST_S = 60.0
"""How long a stored copy's snapshot waits for its version's hand-over to the rollout to end first: on one
H200 at the Qwen2.5-0.5B shape, the validation's pull of a version beside its snapshot took 1.10 s against
0.08-0.21 s alone (the snapshot's GPU reads and host copies compete with the sender's buckets)."""
UNCLAIMED_COPY_WAIT_S = 10.0
"""How long a reader waits for a stored copy that no process has claimed."""


class StoredCopy:
    """A stored copy in the making: `snapshot` resolves once the model may change, `written` once committed
    (each raises the error of its part where it is waited for)."""

    def __init__(self, version: int, snapshot: Callable[[], Any], write: Callable[[Any], None]):
        self.version, self.due = version, threading.Event()
        self.snapshot, self.written = Future(), Future()
        self._steps: tuple | None = (snapshot, write)  # they hold the model: let go before the copy is done
        threading.Thread(target=self._make, name=f"rlhf-weights-copy-{version}", daemon=True).start()

    def _make(self) -> None:
        self.due.wait(HANDOVER_FIRST_S)
        snapshot, write = self._steps
        self._steps = None
        try:  # errors are raised where the copy is waited for
            state = snapshot()
        except BaseException as error:  # noqa: BLE001
            del snapshot, write
            self.snapshot.set_exception(error)
            self.written.set_exception(error)
            return
        del snapshot
        self.snapshot.set_result(None)  # the model may change now
        failed = None
        try:
            write(state)
        except BaseException as error:  # noqa: BLE001
            failed = error
        del write, state  # before anyone waiting for the copy wakes up (a released model is freed)
        if failed is None:
            self.written.set_result(None)
        else:
            self.written.set_exception(failed)


_COPIES: dict[str, StoredCopy] = {}
"""Run folder -> the stored copy of a published policy being made in the background."""
_COPIES_LOCK = threading.Lock()


def start_copy(run_dir: str, version: int, snapshot: Callable[[], Any], write: Callable[[Any], None]) -> None:
    """Start the run's copy of `version` (the caller has finished the one before: `copy_due(..., pop=True)`)."""
    copy = StoredCopy(version, snapshot, write)
    with _COPIES_LOCK:
        _COPIES[run_dir] = copy


def copy_due(run_dir: str, version: int | None = None, pop: bool = False) -> StoredCopy | None:
    """The run's copy in the making (of `version`, if given), told to go ahead now; `pop`: forgotten here."""
    with _COPIES_LOCK:
        copy = _COPIES.get(run_dir)
        if copy is None or (version is not None and copy.version != version):
            return None
        if pop:
            del _COPIES[run_dir]
    copy.due.set()
    return copy


@atexit.register
def _finish_copies() -> None:
    """A process that ends (a worker stopped) finishes the copies it was making first, at once."""
    with _COPIES_LOCK:
        copies = list(_COPIES.values())
    for copy in copies:
        copy.due.set()
        try:
            copy.written.result()
        except BaseException:  # noqa: BLE001 - an unwritten copy is not committed; nothing waits for it now
            pass


def claim(fs, path: str) -> None:
    """Say at `path` that this process writes a stored copy (until `release`)."""
    write_bytes_atomic(fs, path, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())


def release(fs, path: str) -> None:
    with contextlib.suppress(OSError):
        fs.rm(path)


def writer_gone(fs, path: str, waited_s: float) -> str | None:
    """Why nobody will commit the copy claimed at `path` (its writer's process ended or wrote down its error
    there; none claimed it for UNCLAIMED_COPY_WAIT_S), else None. A writer on another host is taken for alive."""
    try:
        writer = json.loads(fs.cat_file(path))
    except (OSError, ValueError):
        return None if waited_s < UNCLAIMED_COPY_WAIT_S else "no process is writing it"
    if writer.get("error"):
        return f"writing it failed in pid {writer.get('pid')} on {writer.get('host')}: {writer['error']}"
    if writer.get("host") == socket.gethostname() and not pid_alive(int(writer.get("pid", 0))):
        return f"the process that was writing it (pid {writer.get('pid')}) has ended"
    return None
