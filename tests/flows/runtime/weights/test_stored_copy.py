"""flows.runtime.weights.stored_copy: a stored copy being written in the background is claimed by its writer
until committed, and a reader in another process waits for it only while that writer lives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from flows.config import build_config
from flows.runtime.weights import stored_copy, transport_for
from flows.runtime.weights.on_storage import StorageTransport
from storage import RunLayout


def _claim(transport, version: int, pid: int, host: str | None = None) -> None:
    """What a process writing the stored copy of `version` in the background leaves (MemoryTransport.publish_weights)."""
    path = transport.writer_path(version)
    transport.layout.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    transport.layout.fs.pipe_file(path, json.dumps({"host": host or socket.gethostname(), "pid": pid}).encode())


def test_a_stored_copy_being_written_is_waited_for_only_while_its_writer_lives(tmp_path, tiny_model, monkeypatch):
    """The rollout (or the driver's export) waits for a copy that the actor's worker writes in the background; an
    actor that died before committing it will never do so: the wait ends at once, saying why, instead of after
    STORED_COPY_WAIT_S (which had held a run for 300 s, then the stage timeout)."""
    reader = StorageTransport(RunLayout(str(tmp_path), "r"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _claim(reader, 3, dead.pid)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"policy version 3 has no stored copy under .*/r/weights/actor/3, and the "
                                           rf"process that was writing it \(pid {dead.pid}\) has ended"):
        reader.committed_copy(3, timeout_s=300)
    assert time.monotonic() - started < 5

    # A live writer is waited for, and its copy taken once committed.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _claim(reader, 4, live.pid)
        writer = StorageTransport(RunLayout(str(tmp_path), "r"))
        committing = threading.Timer(1.0, lambda: writer.publish_weights(tiny_model, 4, torch.float32))
        committing.start()
        assert reader.committed_copy(4, timeout_s=300) == str(tmp_path / "r" / "weights" / "actor" / "4")
        committing.join()
    finally:
        live.kill()
        live.wait()

    # Nobody claimed it: waited for UNCLAIMED_COPY_WAIT_S, not STORED_COPY_WAIT_S.
    monkeypatch.setattr(stored_copy, "UNCLAIMED_COPY_WAIT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"policy version 5 has no stored copy under .*, and no process is writing it"):
        reader.committed_copy(5, timeout_s=300)
    assert 0.5 <= time.monotonic() - started < 5

    # A writer on another host cannot be looked at: the wait is bounded by the timeout alone.
    _claim(reader, 6, dead.pid, host="another-host")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"policy version 6 has no stored copy under .*/6$"):
        reader.committed_copy(6, timeout_s=1.0)
    assert time.monotonic() - started >= 1.0


def test_a_process_claims_the_stored_copy_it_writes_until_it_is_committed(tmp_path, tiny_model):
    config = build_config({"run": {"name": "r", "storage_root": str(tmp_path)},
                           "trainer": {"total_steps": 5, "checkpoint_every": 2}})
    transport = transport_for(config)
    claim = tmp_path / "r" / "weights" / "actor" / "2.writer.json"
    transport.publish_weights(tiny_model, 1, torch.float32)  # no copy due
    assert not (tmp_path / "r" / "weights" / "actor" / "1.writer.json").exists()
    transport.publish_weights(tiny_model, 2, torch.float32)  # due: written after the hand-over
    assert json.loads(claim.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    transport.flush()
    assert (tmp_path / "r" / "weights" / "actor" / "2" / "_COMMITTED").exists() and not claim.exists()
    assert RunLayout(str(tmp_path), "r").step_folders(str(tmp_path / "r" / "weights" / "actor")) == [2]
