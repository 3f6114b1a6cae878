"""The trace of a hand-over (RLHF_WEIGHTS_TRACE=1 in the workers' environment): one line per step on both
sides, `weights-trace <wall clock> pid=<pid> <event> ...`, on the process's stderr, with the long garbage
collections and the busy threads that stall a stream; bench/weights_trace.py lines the two sides up.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

TRACE_ENV = "RLHF_WEIGHTS_TRACE"


def tracing() -> bool:
    return os.environ.get(TRACE_ENV) == "1"


def trace(event: str, **fields) -> None:
    """With RLHF_WEIGHTS_TRACE=1 in the workers' environment, one line per step of a hand-over on both sides
    (`weights-trace <wall clock> pid=<pid> <event> ...`), to line the actor's and the rollout's logs up.
    Written to the process's stderr itself: a flow's `log_prints` would send a print to Prefect's logger."""
    if tracing():
        details = "".join(f" {name}={value}" for name, value in fields.items())
        os.write(2, f"weights-trace {time.time():.6f} pid={os.getpid()} {event}{details}\n".encode())
        if not _GC_TIMED:
            _GC_TIMED.append(True)
            gc.callbacks.append(_time_collection)


_IDLE_FILES = ("threading.py", "selectors.py", "queue.py", "base_events.py", "socket.py", "ssl.py")


def busy_threads(depth: int = 3) -> str:
    """What the process's other threads are doing now, those not waiting (on a lock, a queue, a socket, an
    event loop's select): each as name@file:line:function<... of its innermost `depth` frames."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident() or os.path.basename(frame.f_code.co_filename) in _IDLE_FILES:
            continue
        places = []
        while frame is not None and len(places) < depth:
            places.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}")
            frame = frame.f_back
        busy.append(f"{names.get(ident, ident)}@{'<'.join(places)}".replace(" ", "_"))
    return ",".join(busy) or "-"


_GC_TIMED: list = []  # whether this process traces its garbage collections (from its first traced event on)
_GC_STARTED: dict = {}
GC_TRACE_MS = 5.0


def _time_collection(phase: str, info: dict) -> None:
    """A collection that stopped this process's threads for GC_TRACE_MS or more, as `gc` in the trace: each
    one stops a stream's thread too."""
    if phase == "start":
        _GC_STARTED["at"] = time.perf_counter()
        return
    started = _GC_STARTED.pop("at", None)
    elapsed_ms = 0.0 if started is None else (time.perf_counter() - started) * 1e3
    if elapsed_ms >= GC_TRACE_MS:
        os.write(2, f"weights-trace {time.time():.6f} pid={os.getpid()} gc generation={info.get('generation')} "
                    f"ms={elapsed_ms:.1f} collected={info.get('collected')} "
                    f"thread={threading.current_thread().name}\n".encode())
