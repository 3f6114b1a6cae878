"""What ties a run's processes to it: children that die with their parent, one live driver per run
folder, and a driver that stops at once when its Prefect server is gone.

- `tied_to_this_process` (a command wrapper, Linux) and `watch_parent` (a thread in our own workers): a
  Prefect server or a worker started for a driver exits when the driver dies, even by SIGKILL.
- `RunLock`: an exclusive lock (flock) on `<storage_root>/.locks/<run name>.lock`, held by the driver
  for the whole run: a second live run of the same name is refused before it starts anything, and
  `run.overwrite` can never delete a live run's folder. The kernel drops the lock when the holder dies,
  however it dies. Only for a local storage root (a remote one has no flock; documented).
- `ServerWatch`: a thread that ends the driver with one line when its Prefect server is gone (the process it
  started exited: at once; a server that leaves /health unanswered: after SERVER_PATIENCE_S) instead of the
  client's retries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

STOPPING = threading.Event()
"""Set when this process was asked to stop (SIGTERM, Ctrl-C): what follows is the stop, not a failure."""


def mark_stopping() -> None:
    """Set STOPPING where a stop is caught other than by the CLI's signal handler (the flow, whose SIGTERM Prefect's
    own handler turns into TerminationSignal). A function: the flow's function is pickled by value with its globals
    for task workers (flows.runtime.dispatch), and an Event does not pickle."""
    STOPPING.set()


class Stopped(KeyboardInterrupt):
    """A stage that ran into its process's stop: its roles were released, its engine closed under it, or it raised
    while the process stopped. A KeyboardInterrupt, as the stop itself: Prefect records the task run Crashed and
    does not retry it, and nothing takes it for the stage's own failure."""


PARENT_PID_ENV = "RLHF_PARENT_PID"
"""Set by whoever starts a worker: the pid the worker lives for (watch_parent)."""
_PR_SET_PDEATHSIG = 1


_EXEC_TIED = ("import ctypes, os, signal, sys\n"
              "try:\n    ctypes.CDLL(None).prctl(%d, signal.SIGTERM)\nexcept (OSError, AttributeError):\n    pass\n"
              "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)\n"
              "os.execv(sys.argv[2], sys.argv[2:])\n") % _PR_SET_PDEATHSIG


def tied_to_this_process(command: list[str]) -> list[str]:
    """`command` (its first item an absolute executable) wrapped so that the child gets SIGTERM when this
    process exits, however it exits (Linux's PR_SET_PDEATHSIG, set in the child, kept across exec;
    nothing elsewhere: our workers also run watch_parent). The signal follows the thread that starts the
    child: start it from a thread that lives as long as the child should."""
    return [sys.executable, "-c", _EXEC_TIED, str(os.getpid()), *command]


def watch_parent(on_death: Callable[[], None], interval_s: float = 0.5) -> None:
    """In a worker: when the process named by RLHF_PARENT_PID is gone, call `on_death` (which should exit)."""
    parent = int(os.environ.get(PARENT_PID_ENV) or 0)
    if parent <= 0:
        return

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent and not pid_alive(parent):
                print(f"the process this worker serves (pid {parent}) is gone; exiting", flush=True)
                on_death()
                os._exit(1)

    threading.Thread(target=watch, name="rlhf-parent-watch", daemon=True).start()


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has `pid` (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLockedError(ValueError):
    """Another live process holds the run (a ValueError: the CLI prints it as one line)."""


class RunLock:
    """An exclusive, re-entrant (within this process) lock on one run name under a storage root."""

    _held: dict[str, tuple[int, int]] = {}  # lock path -> (file descriptor, depth) in this process
    _guard = threading.Lock()

    def __init__(self, storage_root: str, run_name: str):
        self.run_name = run_name
        fs, root = fsspec.core.url_to_fs(storage_root)
        self.path = None if not isinstance(fs, LocalFileSystem) else str(Path(root, ".locks", f"{run_name}.lock"))

    def acquire(self) -> None:
        if self.path is None:
            return
        with self._guard:
            if self.path in self._held:
                descriptor, depth = self._held[self.path]
                self._held[self.path] = (descriptor, depth + 1)
                return
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise OSError(error.errno, f"run.storage_root: cannot create the run lock {self.path}: "
                                           f"{error.strerror}") from None
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(descriptor)
                os.close(descriptor)
                raise RunLockedError(
                    f"run.name={self.run_name!r} is live: {holder} holds it ({self.path}); wait for it to end, "
                    "stop it, or choose another run.name") from None
            os.ftruncate(descriptor, 0)
            os.write(descriptor, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                             "since": time.time(), "argv": sys.argv[:6]}).encode())
            self._held[self.path] = (descriptor, 1)

    def release(self) -> None:
        if self.path is None:
            return
        with self._guard:
            descriptor, depth = self._held.get(self.path, (None, 0))
            if descriptor is None:
                return
            if depth > 1:
                self._held[self.path] = (descriptor, depth - 1)
                return
            del self._held[self.path]
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, 0)
            os.close(descriptor)  # closing drops the flock

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(descriptor: int) -> str:
    try:
        holder = json.loads(os.pread(descriptor, 4096, 0) or b"{}")
    except (OSError, ValueError):
        holder = {}
    if not holder:
        return "another process"
    return f"pid {holder.get('pid')} on {holder.get('host')}"


SERVER_PATIENCE_S = 60.0
"""How long a Prefect server may leave /health unanswered before the driver takes it for lost. A server that is
only busy answers late: on the 2-core CI machine, beside two runs' ten processes, the test server left three
2-second looks in a row unanswered and a live run was ended as if its server were gone. The process of a server
we started is watched as well: its exit ends the run at once."""


class ServerWatch:
    """Polls the Prefect server every `interval_s`: calls `on_lost(reason)` once, from the watch thread, when the
    server process we started exits, or when /health has gone unanswered for `patience_s`."""

    def __init__(self, api_url: str, on_lost: Callable[[str], None], process=None, interval_s: float = 1.0,
                 patience_s: float = SERVER_PATIENCE_S):
        self.api_url, self.on_lost, self.process = api_url, on_lost, process
        self.interval_s, self.patience_s = interval_s, patience_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rlhf-server-watch", daemon=True)

    def _exited(self) -> str | None:
        if self.process is not None and self.process.poll() is not None:
            return f"the Prefect server (pid {self.process.pid}) exited with code {self.process.returncode}"
        return None

    def _answer(self) -> str | None:
        """None when /health answered 200, else what happened."""
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=min(2.0, self.patience_s / 3)) as response:
                return None if response.status == 200 else f"answered {response.status}"
        except OSError as error:
            return f"did not answer ({getattr(error, 'reason', error)})"

    def _watch(self) -> None:
        answered = time.monotonic()
        while not self._stop.wait(self.interval_s):
            reason = self._exited()
            if reason is None:
                problem = self._answer()
                if problem is None:
                    answered = time.monotonic()
                    continue
                silent_s = time.monotonic() - answered
                if silent_s < self.patience_s:
                    continue
                reason = self._exited() or (f"the Prefect server at {self.api_url} stopped answering: {problem} "
                                            f"for {silent_s:.0f} s")
            if not self._stop.is_set() and not STOPPING.is_set():
                self.on_lost(reason)
            return

    @contextlib.contextmanager
    def running(self) -> Iterator["ServerWatch"]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
