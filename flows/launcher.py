"""The embedded local default: a Prefect server of our own when PREFECT_API_URL is not set.

Separate processes (the flow, stage workers, deployment workers) need one shared server, so the
launcher starts `prefect server start` on a free loopback port, with its database under
`.rlhf/prefect` so that the history stays browsable later (`rlhf server`), and stops it on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

DEFAULT_PREFECT_HOME = Path(".rlhf/prefect")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_environment(prefect_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PREFECT_HOME=str(prefect_home.resolve()), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_LEVEL=env.get("PREFECT_LOGGING_LEVEL", "WARNING"))
    return env


def wait_until_healthy(api_url: str, process: subprocess.Popen | None, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {process.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the Prefect server at {api_url} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def prefect_server(prefect_home: Path = DEFAULT_PREFECT_HOME, port: int | None = None) -> Iterator[str]:
    """Yield a Prefect API URL: PREFECT_API_URL if set, else a server started (and stopped) here."""
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    prefect_home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = open(prefect_home / "server.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=server_environment(prefect_home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(api_url, process)
        yield api_url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@contextlib.contextmanager
def using_prefect_api(api_url: str, prefect_home: Path = DEFAULT_PREFECT_HOME) -> Iterator[None]:
    """Point this process's Prefect client at `api_url` (settings are read once at import)."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        temporary_settings,
    )

    updates = {PREFECT_API_URL: api_url, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if not os.environ.get("PREFECT_HOME"):
        prefect_home.mkdir(parents=True, exist_ok=True)
        updates[PREFECT_HOME] = str(prefect_home.resolve())
    with temporary_settings(updates=updates):
        try:
            yield
        finally:
            _drain_logs()


def _drain_logs() -> None:
    """Send buffered run logs to the server while it is still up (it may stop right after)."""
    from prefect.logging.handlers import APILogWorker

    try:
        APILogWorker.drain_all(timeout=10)
    except Exception:  # logs are best effort; the run's outcome is decided elsewhere
        pass
