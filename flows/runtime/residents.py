"""Process-local resident instances: each role's model loads once per process and stays across steps.

`resident(config, name, build)` returns the instance of `name` for the config's run, building it on first
use; whichever process runs a stage (the flow's own, or a role's worker) keeps its roles here, keyed by
run. What a role is and how it is built is the training flow's business (flows/training/roles.py).

A stop releases the run's roles (the flow's `finally`) while stages may still run on other threads of the
process: from then on the run is fenced in this process, and a stage that asks for a role (or finishes building
one) gets `Stopped` instead of loading a model that nothing would close (a vLLM engine's processes).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from flows.config import Config, layout_for
from flows.runtime.recovery import read_run_record
from flows.runtime.supervision import STOPPING, Stopped

_RESIDENTS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()
# transformers' from_pretrained is not thread-safe (concurrent loads in one process left tied weights
# on the meta device here), so roles of one process load one at a time; separate workers still overlap.
_LOAD_LOCK = threading.RLock()  # re-entrant: a builder may ask for another role (the tokenizer)
LOAD_COUNTS: dict[str, int] = {}
"""How many times each role was built in this process (heartbeats report it; tests check models load once)."""
_RUN_CREATED: dict[str, str | None] = {}
"""When the run whose roles this process holds was created (its run record), by run folder."""
_STOPPED: set[str] = set()
"""Runs whose roles a stop released in this process (by run folder): none of their roles is built again."""


def _run_key(config: Config) -> str:
    return f"{config.run.storage_root}/{config.run.name}"


def resident(config: Config, name: str, build: Callable[[], Any]) -> Any:
    """The resident instance of `name` for this run, built with `build()` on first use. Raises Stopped once a stop
    released the run's roles (a role built meanwhile is closed again)."""
    key = (_run_key(config), name)
    with _LOCK:
        if key in _RESIDENTS:
            return _RESIDENTS[key]
    _refuse_when_stopped(config, name)
    with _LOAD_LOCK:
        with _LOCK:
            if key in _RESIDENTS:
                return _RESIDENTS[key]
            # A long-lived worker serves one run at a time: free the models of earlier runs first.
            stale = [other for other in _RESIDENTS if other[0] != key[0]]
            closing = [_RESIDENTS.pop(other) for other in stale]
        for instance in closing:
            _close(instance)
        _refuse_when_stopped(config, name)  # the stop came while another role loaded
        instance = build()
        with _LOCK:
            if not stopped(config):
                _RESIDENTS[key] = instance
                LOAD_COUNTS[name] = LOAD_COUNTS.get(name, 0) + 1
                return instance
        _close(instance)  # the stop released the run while this role was built: nothing else would close it
        raise Stopped(f"the run was stopped while role {name} was built; it was closed again")


def stopped(config: Config) -> bool:
    """Whether a stop released this run's roles in this process (stages still running find them gone)."""
    return _run_key(config) in _STOPPED and STOPPING.is_set()


def _refuse_when_stopped(config: Config, name: str) -> None:
    if stopped(config):
        raise Stopped(f"the run was stopped and its roles released; role {name} is not built again")


def forget_earlier_run(config: Config) -> None:
    """Before a stage in a worker: drop the roles of an earlier run that had this run's name. A worker
    started by hand outlives runs; a new run under the same name (run.overwrite=true) has a new run
    record, and none of the earlier run's models (or its engine's weights) may serve it."""
    try:
        created = read_run_record(layout_for(config)).get("created")
    except ValueError:  # no run record (a stage called outside a run): nothing to tell apart
        return
    key = _run_key(config)
    if key in _RUN_CREATED and _RUN_CREATED[key] != created:
        release_run(config)
    _RUN_CREATED[key] = created


def release_role(config: Config, name: str) -> None:
    """Drop one role of this run (it is built again on next use)."""
    with _LOCK:
        instance = _RESIDENTS.pop((_run_key(config), name), None)
    if instance is not None:
        _close(instance)


def release_run(config: Config) -> None:
    """Drop every role of this run (end of run, or before a fresh start under the same name). During a stop
    (STOPPING) the run stays fenced: a stage still running that asks for a role gets Stopped (see `resident`)."""
    key = _run_key(config)
    with _LOCK:
        if STOPPING.is_set():
            _STOPPED.add(key)
        else:
            _STOPPED.discard(key)
        instances = [_RESIDENTS.pop(other) for other in [other for other in _RESIDENTS if other[0] == key]]
    for instance in instances:
        _close(instance)


def _close(instance: Any) -> None:
    """Stop what a role holds beyond Python objects (the vLLM engine's processes)."""
    close = getattr(instance, "close", None)
    if callable(close):
        close()
