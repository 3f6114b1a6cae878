"""A role's long-lived worker: a Prefect task worker pinned to its devices.

    rlhf worker --role actor --devices 0,1      # GPU indices relative to CUDA_VISIBLE_DEVICES
    rlhf worker --role reward --devices cpu

CUDA_VISIBLE_DEVICES is set before CUDA initializes (torch reads it then, not at import), so the worker sees only its GPUs. Models
load on first use and stay resident (flows.training.roles) across steps. The worker writes a heartbeat file
(`<heartbeat dir>/<role>-<host>-<pid>.json`) every second: which task runs it holds, which it is done
with, since when it has been idle, which stages it finished and how many times it loaded each model.
The driver reads these files to tell a slow stage from a dead worker, and prints the worker's latest progress
lines (model loads, the engine start, the warm-start) that the heartbeat also holds; the directory may be on
shared storage (any fsspec URI) for workers on other hosts.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, Mapping

import fsspec
from prefect.task_worker import serve

from components.distributed import broadcast_call, init_from_environment
from components.vllm_build import preload_vllm
from flows.runtime.console import PROGRESS_LOGGER, quiet_console
from flows.runtime.residents import LOAD_COUNTS, forget_earlier_run
from flows.runtime.supervision import watch_parent
from flows.runtime.system_metrics import stop_system_metrics
from storage import write_bytes_atomic

DEFAULT_HEARTBEAT_DIR = ".rlhf/workers"
HEARTBEAT_INTERVAL_S = 1.0
DONE_KEPT = 64
"""How many of its most recent task run ids a heartbeat lists as done."""
PROGRESS_KEPT = 16
"""How many of its latest progress lines a heartbeat holds for the driver to print (Heartbeat.note_progress)."""

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def heartbeat_dir() -> str:
    return os.environ.get("RLHF_WORKER_DIR", DEFAULT_HEARTBEAT_DIR)


class Heartbeat:
    """What this worker process is doing, written atomically to its heartbeat file every second; `serves`: the roles
    whose stages it serves, its own and those of `also_serve` (the driver's RunTracker reads it)."""

    def __init__(self, role: str, devices: str, directory: str, also_serve=()):
        self.fs, root = fsspec.core.url_to_fs(directory)
        self.fs.makedirs(root, exist_ok=True)
        self.path = f"{root.rstrip('/')}/{role}-{socket.gethostname()}-{os.getpid()}.json"
        self.state = {"role": role, "serves": [role, *also_serve], "host": socket.gethostname(), "pid": os.getpid(),
                      "devices": devices, "started": time.time(), "running": [], "finished": [], "done": [],
                      "idle_since": time.time(), "load_counts": {}}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # the beat thread and the stage thread both write
        self._stop = threading.Event()

    def write(self) -> None:
        """Write the heartbeat file atomically; a storage error is left to the next beat."""
        try:
            with self._write_lock:
                self._write()
        except OSError as error:
            print(f"heartbeat write failed (retried next beat): {error}", flush=True)

    def _write(self) -> None:
        torch = sys.modules.get("torch")  # only if this worker already uses it: never import it here
        with self._lock:
            self.state["beat"] = time.time()
            self.state["load_counts"] = dict(LOAD_COUNTS)
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                self.state["cuda_peak_allocated_gib"] = [
                    round(torch.cuda.max_memory_allocated(index) / 2**30, 2) for index in range(torch.cuda.device_count())]
            payload = json.dumps(self.state)
        temporary = f"{self.path}.tmp"
        with self.fs.open(temporary, "w") as handle:
            handle.write(payload)
        self.fs.mv(temporary, self.path)

    def note_progress(self, message: str) -> None:
        """Keep a progress line of this worker (numbered, timed; the newest PROGRESS_KEPT) in the heartbeat, written
        at once: the driver prints it on its terminal (flows.runtime.dispatch.ProgressRelay)."""
        with self._lock:
            lines = self.state.setdefault("progress", [])
            number = lines[-1][0] + 1 if lines else 1
            self.state["progress"] = [*lines, [number, time.time(), message]][-PROGRESS_KEPT:]
        self.write()

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):
                self.write()

        self.write()
        threading.Thread(target=loop, name="rlhf-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.fs.rm(self.path)
        except OSError:
            pass

    def running(self, task_run_id: str, stage: str, step) -> "_Running":
        return _Running(self, task_run_id, stage, step)

    @contextlib.contextmanager
    def preloading(self, modules) -> Iterator[None]:
        """Not idle while it imports `modules` before serving: a stage queued for this worker meanwhile
        is waiting for it, not lost (flows.runtime.dispatch takes a run for lost when a worker sits idle)."""
        with self._lock:
            self.state["idle_since"], self.state["preloading"] = None, list(modules)
        self.write()
        try:
            yield
        finally:
            with self._lock:
                self.state.pop("preloading", None)
                if not self.state["running"]:
                    self.state["idle_since"] = time.time()
            self.write()


class ProgressToHeartbeat(logging.Handler):
    """On the progress logger of a worker: each progress line also goes into its heartbeat."""

    def __init__(self, heartbeat: Heartbeat):
        super().__init__()
        self.heartbeat = heartbeat

    def emit(self, record: logging.LogRecord) -> None:
        self.heartbeat.note_progress(record.getMessage())


class _Running:
    def __init__(self, heartbeat: Heartbeat, task_run_id: str, stage: str, step):
        self.heartbeat, self.task_run_id, self.stage, self.step = heartbeat, task_run_id, stage, step

    def __enter__(self):
        with self.heartbeat._lock:
            self.heartbeat.state["running"].append(self.task_run_id)
            self.heartbeat.state["idle_since"] = None
        self.heartbeat.write()

    def __exit__(self, *exc):
        with self.heartbeat._lock:
            state = self.heartbeat.state
            state["running"].remove(self.task_run_id)
            # Its final state reaches the server a moment later (Prefect sends task run states as
            # events): the driver waits for it rather than taking the run for lost.
            state["done"] = [*state["done"], self.task_run_id][-DONE_KEPT:]
            if not state["running"]:
                state["idle_since"] = time.time()
            if exc[0] is None:
                state["finished"].append([self.stage, self.step])
        self.heartbeat.write()


CURRENT: Heartbeat | None = None
"""The heartbeat of this process when it is a worker (None in the driver)."""

RESULTS_SUBDIR = "results"
"""Where a worker leaves each finished stage's return value for the driver (`<heartbeat dir>/results/`), as
JSON: nothing the driver reads from this (possibly shared) folder can run code in it."""


def _result_path(task_run_id: str, directory: str | None = None):
    fs, root = fsspec.core.url_to_fs(directory or heartbeat_dir())
    return fs, f"{root.rstrip('/')}/{RESULTS_SUBDIR}/{task_run_id}.json"


def publish_result(task_run_id: str, value, directory: str | None = None) -> bool:
    """Leave a finished stage's return value where the driver looks first (atomically: written, then
    renamed). The driver then need not wait for the task run's Completed state, which Prefect records
    from an event, at times seconds late (see flows.runtime.dispatch). False when it could not be written: the
    driver then waits for the state, as before."""
    try:
        write_bytes_atomic(*_result_path(task_run_id, directory), json.dumps(value).encode())
        return True
    except (OSError, TypeError, ValueError) as error:  # TypeError: a value JSON cannot hold
        print(f"stage result not published (the driver waits for the Prefect state): {error}", flush=True)
        return False


def take_result(task_run_id: str, directory: str | None = None) -> tuple[bool, object]:
    """(True, value) when a worker published the task run's result (the file is removed), else (False, None)."""
    fs, path = _result_path(task_run_id, directory)
    try:
        with fs.open(path, "rb") as handle:
            value = json.loads(handle.read())
    except (OSError, ValueError):  # not there (yet), or storage hiccup: look again later
        return False, None
    try:
        fs.rm(path)
    except OSError:  # a stale file costs a few bytes, not correctness: task run ids are not reused
        pass
    return True, value


def read_heartbeats(directory: str | None = None) -> Iterator[dict]:
    """Every worker heartbeat in the directory (unreadable or half-written files are skipped)."""
    fs, root = fsspec.core.url_to_fs(directory or heartbeat_dir())
    if not fs.exists(root):
        return
    for path in fs.glob(f"{root.rstrip('/')}/*.json"):
        try:
            with fs.open(path) as handle:
                yield json.load(handle)
        except (OSError, ValueError):
            continue


def pin_devices(devices: str) -> str:
    """Set CUDA_VISIBLE_DEVICES for `devices` ("cpu" or indices relative to the current visible set)."""
    if devices == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return ""
    indices = [int(part) for part in devices.split(",") if part.strip()]
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [part.strip() for part in current.split(",")] if current else None
    if visible is not None:
        if any(index < 0 or index >= len(visible) for index in indices):
            raise ValueError(f"--devices {devices}: CUDA_VISIBLE_DEVICES={current} makes {len(visible)} GPUs "
                             f"visible; use indices 0-{len(visible) - 1} or cpu")
        physical = [visible[index] for index in indices]
    else:
        physical = [str(index) for index in indices]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical)
    return os.environ["CUDA_VISIBLE_DEVICES"]


def _start_followers(role: str, count: int) -> list:
    """Ranks 1..count-1 of a sharded role, as child processes (same process group as rank 0)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(count),
                      RANK="0", LOCAL_RANK="0")
    followers = []
    for rank in range(1, count):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank))
        followers.append(subprocess.Popen([sys.executable, "-m", "flows.tools.cli", "worker", "--role", role,
                                           "--devices", ",".join(map(str, range(count))), "--follower"], env=env))
    return followers


def _exit_when_a_follower_dies(followers: list) -> None:
    """A dead rank would leave rank 0 waiting in a collective forever: exit so the pool restarts us."""
    def watch() -> None:
        while True:
            for follower in followers:
                if follower.poll() is not None:
                    print(f"rank of pid {follower.pid} exited with code {follower.returncode}; stopping", flush=True)
                    for other in followers:
                        other.kill()
                    os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, name="rlhf-follower-watch", daemon=True).start()


def follow(functions: Mapping[str, Callable]) -> None:
    """A rank > 0 of a sharded role (devices already pinned): run every stage call that rank 0 broadcasts,
    in order; `functions` maps the stage names that run on every rank to their functions (the others,
    such as the warm-start, rank 0 does alone)."""
    init_from_environment()
    while True:
        call = broadcast_call(None)
        if call is None:
            return
        stage, args, kwargs = call
        if stage not in functions:
            continue
        try:
            forget_earlier_run(args[0] if args else kwargs["config"])  # as rank 0 does (flows.runtime.tasks)
            functions[stage](*args, **kwargs)
        except Exception:  # noqa: BLE001 - rank 0 reports the stage's failure; stay in step with it
            traceback.print_exc()


def settle_heap() -> None:
    """A full collection, then gc.freeze(): what is alive now (the imported libraries, a loaded model) stays
    out of every later collection, as vLLM's engine core does at its start. A worker with torch,
    transformers, Prefect and MLflow imported holds ~630k objects, whose full collection took 260 ms on a
    2-core machine; a collection stops every thread of the process, the actor's weights thread in the middle
    of a hand-over included. (With it, the actors' workers of four GPU runs made two collections of 5 ms or
    more, 35 and 50 ms, none during a hand-over; the packing stalls point to the GIL: components/weight_sync/buckets.py,
    PackPlan.)"""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    # To the worker's log itself: inside a stage, a flow's log_prints would send a print to Prefect's logger.
    os.write(2, f"heap settled: {gc.get_freeze_count():,} objects left out of later collections "
                f"({time.perf_counter() - started:.2f} s)\n".encode())


def preload_modules(modules) -> None:
    """Import what this role's first stage would (vLLM for a vLLM rollout) before serving, so that it
    happens while the driver sets up rather than inside the first stage. A failed import is printed and
    left to that stage to report."""
    for module in modules:
        started = time.perf_counter()
        try:
            if module == "vllm":  # imported without leaving vLLM's environment edits in this process

                preload_vllm()
            else:
                importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - the stage that needs it raises the real error
            print(f"preload {module}: {type(error).__name__}: {error}", flush=True)
            continue
        print(f"preloaded {module} in {time.perf_counter() - started:.1f} s", flush=True)


RESUBSCRIBE_WAIT_S = (0.5, 1.0, 2.0, 5.0, 10.0)
"""Waits before subscribing again after Prefect's task worker ended, the n-th time in a row (then the last)."""


def serve_until_stopped(tasks: list) -> None:
    """Serve `tasks` (one stage at a time: a role's model is not safe to use from two stages at once) until this
    process is stopped. A stop (SIGTERM or SIGINT: the CLI raises KeyboardInterrupt in the main thread, where this
    waits; Prefect runs `serve` in a thread of its own and leaves the signals alone) ends this too; any other end
    is a broken subscription to the server, and the worker subscribes again rather than exit with its model and
    training state. Prefect reconnects only after a refused or broken connection: a reconnect that times out
    (the server busy for 10 s) ends its `serve` without an error. That had ended all four workers of a run at
    once, with code 0, on the 2-core CI machine, and the replaced actor no longer held the weights the rollout
    waited for. A stage still running when the subscription ends finishes first (Prefect's executor waits for it):
    two stages never run at once."""
    in_a_row = 0
    while True:
        started = time.monotonic()
        try:
            serve(*tasks, limit=1)
            reason = "its subscription to the server ended"
        except Exception as error:  # noqa: BLE001 - printed; the worker subscribes again
            reason = f"{type(error).__name__}: {error}"
        in_a_row = 1 if time.monotonic() - started > 60 else in_a_row + 1
        wait_s = RESUBSCRIBE_WAIT_S[min(in_a_row, len(RESUBSCRIBE_WAIT_S)) - 1]
        print(f"{time.strftime('%H:%M:%S')} task worker: {reason}; subscribing again in {wait_s:g} s", flush=True)
        time.sleep(wait_s)


def serve_role(role: str, visible: str, tasks: list, directory: str | None = None, preload=(),
               sharded: bool = False, also_serve=()) -> None:
    """Serve this role's stage `tasks` until stopped, its devices already pinned (`visible`: what
    pin_devices returned; "" on the CPU): start the ranks of a `sharded` role on several GPUs, the
    heartbeat, and import the `preload` modules first. `also_serve`: the other roles whose stages `tasks` hold."""
    global CURRENT
    count = len(visible.split(",")) if visible else 0
    followers = []
    if count > 1 and sharded:
        followers = _start_followers(role, count)

        init_from_environment()
        _exit_when_a_follower_dies(followers)

    CURRENT = Heartbeat(role, visible or "cpu", directory or heartbeat_dir(), also_serve)
    CURRENT.start()
    # Started for a driver (`rlhf run`): gone when it is, even when it was SIGKILLed.
    watch_parent(on_death=CURRENT.stop)
    try:
        # The worker's log: progress lines, not every task run's lifecycle (before the preload: vLLM's import reads
        # VLLM_LOGGING_LEVEL); each progress line also goes to the driver's terminal, through the heartbeat.
        quiet_console()
        logging.getLogger(PROGRESS_LOGGER).addHandler(ProgressToHeartbeat(CURRENT))
        with CURRENT.preloading(preload):
            preload_modules(preload)
            settle_heap()
        serve_until_stopped(tasks)
    finally:
        stop_system_metrics()
        CURRENT.stop()
        if followers:
            broadcast_call(None)
