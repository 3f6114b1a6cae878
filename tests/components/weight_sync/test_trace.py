"""components.weight_sync.trace (RLHF_WEIGHTS_TRACE=1): what it adds to find a stalled hand-over, the
process's long garbage collections and what its other threads were doing."""

from __future__ import annotations

import gc
import threading
import time

from components.weight_sync import trace as weight_trace
from components.weight_sync.trace import busy_threads, trace


def test_a_traced_process_reports_its_long_collections(monkeypatch, capfd):
    monkeypatch.setenv(weight_trace.TRACE_ENV, "1")
    monkeypatch.setattr(weight_trace, "GC_TRACE_MS", 0.0)  # every collection is "long"
    trace("first")  # the first traced event starts timing collections
    try:
        garbage = [[] for _ in range(1000)]
        for item in garbage:  # cycles: only a collection frees them
            item.append(item)
        del garbage, item
        gc.collect()
        lines = capfd.readouterr().err.splitlines()
        assert any(line.endswith(" first") for line in lines), lines
        collections = [line for line in lines if " gc generation=2 " in line]
        assert collections and "collected=" in collections[-1], lines
        assert int(collections[-1].split("collected=")[1].split()[0]) >= 1000
        assert collections[-1].split("thread=")[1] == "MainThread"
    finally:
        gc.callbacks.remove(weight_trace._time_collection)
        weight_trace._GC_TIMED.clear()


def test_untraced_no_collection_is_timed(monkeypatch, capfd):
    monkeypatch.delenv(weight_trace.TRACE_ENV, raising=False)
    trace("nothing")
    gc.collect()
    assert weight_trace._time_collection not in gc.callbacks and capfd.readouterr().err == ""


def spin_here(stop: list) -> None:
    while not stop:  # a plain list, not an Event: its is_set() would put the thread in threading.py at times
        sum(range(1000))


def test_busy_threads_names_a_working_thread_and_leaves_out_a_waiting_one():
    stop, stopped = [], threading.Event()
    working = threading.Thread(target=spin_here, args=(stop,), name="worker one")
    waiting = threading.Thread(target=stopped.wait, name="waiter")
    working.start(), waiting.start()
    try:
        time.sleep(0.05)
        busy = busy_threads()
    finally:
        stop.append(True)
        stopped.set()
        working.join(), waiting.join()
    entries = busy.split(",")
    assert any(entry.startswith("worker_one@") and "spin_here" in entry for entry in entries), busy
    assert not any(entry.startswith("waiter@") for entry in entries), busy

