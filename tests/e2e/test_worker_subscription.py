"""A worker outlives a server that stops answering for a minute (real Prefect server, real task worker): Prefect's
own `serve` returns when its reconnect times out, which had ended every worker of a run at once; the worker
subscribes again and serves the next task run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _answered(task, x: int, answer: Path, worker: subprocess.Popen, log: Path) -> None:
    """Submit `task` to the worker and wait for its answer file (the run's state travels back through the server's
    events, which the stall may have left behind: not what this test is about)."""
    task.delay(x, str(answer))
    deadline = time.monotonic() + 300
    while not answer.exists():
        assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    assert answer.read_text() == str(2 * x)


def test_a_worker_subscribes_again_after_its_server_stalled_and_serves_the_next_run(tmp_path, monkeypatch):
    from flows.runtime.launcher import EMBEDDED_SERVERS, prefect_server, using_prefect_api

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    sys.path.insert(0, str(Path(__file__).parent))
    monkeypatch.setattr(sys, "path", sys.path)
    import echo_task

    home, storage = tmp_path / "prefect", str(tmp_path / "results")
    with prefect_server(prefect_home=home) as api_url, \
            using_prefect_api(api_url, prefect_home=home, local_storage_path=storage):
        server = EMBEDDED_SERVERS[api_url]
        env = dict(os.environ, PREFECT_API_URL=api_url, PREFECT_LOCAL_STORAGE_PATH=storage,
                   PREFECT_HOME=str(home.resolve()), PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]))
        log = tmp_path / "worker.log"
        with open(log, "w") as output:
            worker = subprocess.Popen(
                [sys.executable, "-c", "import echo_task\nfrom flows.runtime.worker import serve_until_stopped\n"
                                       "serve_until_stopped([echo_task.double])"],
                env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _answered(echo_task.double, 1, tmp_path / "first", worker, log)
            # Stopped, the server keeps its connections open and answers nothing: the worker's keepalive pings go
            # unanswered (~40 s), then its reconnect times out (10 s).
            os.killpg(server.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 180
                while "task worker: its subscription to the server ended" not in log.read_text():
                    assert worker.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(1)
            finally:
                os.killpg(server.pid, signal.SIGCONT)
            _answered(echo_task.double, 2, tmp_path / "second", worker, log)
        finally:
            worker.kill()
            worker.wait(timeout=60)
