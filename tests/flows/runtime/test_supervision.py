"""ServerWatch against a real HTTP server that stalls: a busy server is waited for, a silent one is lost after
the patience, and the exit of a server process we started is lost at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flows.runtime.supervision import ServerWatch


class _Health(BaseHTTPRequestHandler):
    stall_until = 0.0  # the server holds each request until then

    def do_GET(self):  # noqa: N802 - http.server's name
        while time.monotonic() < type(self).stall_until:
            time.sleep(0.02)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Health.stall_until = 0.0
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    _Health.stall_until = 0.0
    server.shutdown()


def _watch(api_url, process=None, patience_s=1.0):
    lost: list[tuple[float, str]] = []
    watch = ServerWatch(api_url, on_lost=lambda reason: lost.append((time.monotonic(), reason)), process=process,
                        interval_s=0.05, patience_s=patience_s)
    return watch, lost


def test_a_server_that_answers_late_is_waited_for_and_one_silent_past_the_patience_is_lost(health_server):
    watch, lost = _watch(health_server, patience_s=1.5)  # each look waits 0.5 s for its answer
    with watch.running():
        time.sleep(0.3)
        _Health.stall_until = time.monotonic() + 1.0  # busy: looks go unanswered for 1 s, within the patience
        time.sleep(2.0)
        assert lost == []
        silent_from = time.monotonic()
        _Health.stall_until = time.monotonic() + 60  # silent
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(lost) == 1, lost
    at, reason = lost[0]
    assert at - silent_from >= 1.5 - 0.1, at - silent_from  # not before the patience (minus one poll)
    assert reason.startswith(f"the Prefect server at {health_server} stopped answering: did not answer "), reason
    assert reason.endswith(" s"), reason


def test_a_refused_connection_is_lost_after_the_patience_too(health_server):
    closed = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = closed.server_address[1]
    closed.server_close()  # nothing listens there now
    watch, lost = _watch(f"http://127.0.0.1:{port}/api", patience_s=0.5)
    started = time.monotonic()
    with watch.running():
        time.sleep(2.0)
    assert len(lost) == 1, lost
    assert lost[0][0] - started >= 0.5
    assert "stopped answering: did not answer (" in lost[0][1] and "Connection refused" in lost[0][1], lost


def test_the_exit_of_the_server_process_we_started_is_lost_at_once_however_it_answers(health_server):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    watch, lost = _watch(health_server, process=process, patience_s=60)
    with watch.running():
        process.wait()
        exited = time.monotonic()
        while not lost and time.monotonic() < exited + 5:
            time.sleep(0.02)
    assert [reason for _, reason in lost] == [f"the Prefect server (pid {process.pid}) exited with code 0"]
    assert lost[0][0] - exited < 1.0


def test_a_stopped_watch_reports_nothing(health_server):
    watch, lost = _watch(health_server, patience_s=0.2)
    with watch.running():
        time.sleep(0.2)
    _Health.stall_until = time.monotonic() + 60
    time.sleep(0.6)
    assert lost == []


def test_the_flow_marks_a_stop_through_a_function_and_still_pickles_for_task_workers():
    """Prefect's SIGTERM handler raises in the flow before the CLI's marks the stop: the flow marks it (mark_stopping).
    The flow's function is pickled by value with the globals it names when a stage goes to a task worker, so it names
    a function, not the Event (which does not pickle: every stage under workers failed so)."""
    import cloudpickle

    from flows.runtime.supervision import STOPPING, mark_stopping
    from flows.training.train import train

    assert cloudpickle.loads(cloudpickle.dumps(train)).name == "rlhf-train"
    try:
        mark_stopping()
        assert STOPPING.is_set()
    finally:
        STOPPING.clear()
