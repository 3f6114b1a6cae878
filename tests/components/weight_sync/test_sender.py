"""components.weight_sync.sender and .receiver, the two ends of a weights stream, between two real processes
on the CPU (gloo): a policy version reaches the rollout engine of another process bit for bit in several
buckets; a sender holding another version says so; a receiver that fails midway is replaced and its
replacement gets everything; a dead sender or an abort ends the other side's wait instead of hanging it; the
sender's thread polls the store at the pace a hand-over needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from components.rollout import HFRolloutEngine
from components.weight_sync import channel as weight_channel
from components.weight_sync.channel import Channel, StreamError, connect, poll
from components.weight_sync.receiver import RemoteWeights, WeightsUnavailable, abort
from components.weight_sync.sender import _OPEN_SENDERS, WeightSender

SENDER = Path(__file__).with_name("stream_sender.py")
BUCKET_BYTES = 64 * 1024  # the tiny model is ~0.5 MB in float32: several buckets


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_sender(tmp_path, model_path, sync: str, version: int = 3, holds: bool = True, ranks: int = 0,
                  device: str = "cpu"):
    """The sender script in a process of its own, or as `ranks` FSDP ranks under torchrun."""
    channel_file = tmp_path / f"channel-{sync}.json"
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                 f"--master-port={_free_port()}"] if ranks else [sys.executable])
    process = subprocess.Popen([*launcher, str(SENDER), model_path, str(channel_file), sync, str(version),
                                "1" if holds else "0", str(BUCKET_BYTES), device], stdout=subprocess.PIPE, text=True,
                               # CPU ranks on a GPU host too (FSDP's device mesh would take a GPU per rank)
                               env={**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})})
    deadline = time.monotonic() + 120
    while not channel_file.exists() or not channel_file.read_text():
        assert process.poll() is None, "the sender exited before opening its channel"
        assert time.monotonic() < deadline, "the sender did not open its channel"
        time.sleep(0.1)
    return process, Channel.from_json(channel_file.read_text())


def _metrics(process) -> dict:
    """Rank 0's metrics (the only process's)."""
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    reports = [json.loads(line) for line in output.strip().splitlines() if line.startswith("{")]
    assert len({report["rank"] for report in reports}) == len(reports)
    return {key: value for key, value in next(r for r in reports if r["rank"] == 0).items() if key != "rank"}


def _expected(model_path) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(SENDER.parent))
    from stream_sender import perturb

    from components.models import load_causal_lm

    return perturb(load_causal_lm(model_path, dtype="float32", device="cpu")).state_dict()


def _engine(model_path) -> HFRolloutEngine:
    return HFRolloutEngine.from_pretrained(model_path, dtype="float32", device="cpu")


def test_a_version_streams_from_another_process_into_the_engine_bit_for_bit(tmp_path, model_path):
    process, channel = _start_sender(tmp_path, model_path, "rollout-3-a")
    engine = _engine(model_path)
    expected = _expected(model_path)
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    remote = RemoteWeights(lambda: channel, sync="rollout-3-a", version=3, timeout_s=60)
    buckets = remote.receive_into(engine)
    remote.finish()
    state = engine.model.state_dict()
    changed = [name for name in state if not torch.equal(state[name], before[name])]
    assert changed and all(torch.equal(state[name], expected[name]) for name in state)
    total = sum(tensor.numel() * tensor.element_size() for tensor in expected.values())
    assert buckets >= total // BUCKET_BYTES >= 4  # one bucket at a time, never the whole model
    metrics = _metrics(process)
    assert metrics["weights/streams"] == 1.0 and "weights/send_timeout" not in metrics


def test_a_pull_asked_ahead_is_answered_while_the_engine_is_busy_and_read_by_the_load(tmp_path, model_path):
    """`ask` (a sleeping vLLM engine posts its pull before it wakes): the sender answers without waiting for
    the load, and the load reads that answer; one pull in all."""
    process, channel = _start_sender(tmp_path, model_path, "rollout-3-g")
    engine = _engine(model_path)
    remote = RemoteWeights(lambda: channel, sync="rollout-3-g", version=3, timeout_s=60)
    remote.ask(engine)
    store = connect(channel)
    assert json.loads(poll(store, "reply/1", time.monotonic() + 60))["status"] == "stream"
    assert remote.receive_into(engine) >= 4
    assert int(store.add("requests", 0)) == 1  # the load posted no second pull
    remote.finish()
    expected = _expected(model_path)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in engine.model.state_dict().items())
    assert _metrics(process)["weights/streams"] == 1.0


def test_a_sharded_actor_gathers_and_streams_in_lockstep(tmp_path, model_path):
    """Two FSDP2 ranks (gloo): every rank gathers each parameter in turn, rank 0 sends; the engine gets the
    whole unsharded model, and both ranks end with the sync."""
    process, channel = _start_sender(tmp_path, model_path, "rollout-8-f", ranks=2)
    engine = _engine(model_path)
    remote = RemoteWeights(lambda: channel, sync="rollout-8-f", version=3, timeout_s=120)
    assert remote.receive_into(engine) >= 4
    remote.finish()
    expected = _expected(model_path)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in engine.model.state_dict().items())
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    reports = {report["rank"]: report for report in map(json.loads, filter(lambda line: line.startswith("{"),
                                                                          output.splitlines()))}
    assert sorted(reports) == [0, 1] and all(report["weights/streams"] == 1.0 for report in reports.values())


def test_a_sender_holding_another_version_says_so_and_ends_with_the_sync(tmp_path, model_path):
    process, channel = _start_sender(tmp_path, model_path, "rollout-4-b", version=4, holds=False)
    remote = RemoteWeights(lambda: channel, sync="rollout-4-b", version=4, timeout_s=60)
    engine = _engine(model_path)
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    with pytest.raises(WeightsUnavailable, match="holds policy version None, not 4"):
        remote.receive_into(engine)
    assert all(torch.equal(tensor, before[name]) for name, tensor in engine.model.state_dict().items())
    remote.finish()
    assert _metrics(process)["weights/streams"] == 0.0


class _FailsOnSecondBucket:
    """A loader (the rollout's engine) that breaks on its second bucket, once it has received it (a process
    that dies instead closes its end of the group, which ends the sender's broadcast at once)."""

    def __init__(self, engine):
        self.engine, self.loaded = engine, 0
        self.weight_session = engine.weight_session

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def load_bucket(self, specs, payload):
        self.engine.load_bucket(specs, payload)
        self.loaded += 1
        if self.loaded == 2:
            raise RuntimeError("rollout worker lost")


def test_a_receiver_that_fails_midway_is_replaced_and_the_replacement_gets_everything(tmp_path, model_path):
    process, channel = _start_sender(tmp_path, model_path, "rollout-5-c")
    engine = _engine(model_path)
    remote = RemoteWeights(lambda: channel, sync="rollout-5-c", version=3, timeout_s=60)
    with pytest.raises(RuntimeError, match="rollout worker lost"):
        remote.receive_into(_FailsOnSecondBucket(engine))
    # The stage is run again (a new worker: a new session and group); the sender, still waiting for the
    # first receiver's ack, takes the newer pull instead.
    replacement = _engine(model_path)
    started = time.monotonic()
    RemoteWeights(lambda: channel, sync="rollout-5-c", version=3, timeout_s=60).receive_into(replacement)
    assert time.monotonic() - started < 20  # not the sender's 30 s ack timeout
    remote.finish()
    expected = _expected(model_path)
    assert all(torch.equal(tensor, expected[name]) for name, tensor in replacement.model.state_dict().items())
    assert _metrics(process)["weights/streams"] == 2.0


def test_a_dead_sender_ends_the_receivers_wait(tmp_path, model_path):
    process, channel = _start_sender(tmp_path, model_path, "rollout-6-d")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    remote = RemoteWeights(lambda: channel, sync="rollout-6-d", version=3, timeout_s=600, connect_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(StreamError, match="no reachable weights channel"):
        remote.receive_into(_engine(model_path))
    assert time.monotonic() - started < 30
    remote.finish()  # nobody to tell: no error


def test_the_drivers_abort_ends_a_sender_waiting_for_its_pull(tmp_path, model_path):
    process, channel = _start_sender(tmp_path, model_path, "rollout-7-e")
    abort(Channel(**{**channel.__dict__, "token": "not-the-token"}), "rollout-7-e")  # ignored: wrong token
    time.sleep(1)
    assert process.poll() is None
    abort(channel, "rollout-7-e")
    assert _metrics(process) == {"weights/streams": 0.0, "timing_s/send_weights": 0.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA IPC)")
def test_on_one_gpu_a_version_goes_over_cuda_ipc_between_processes(tmp_path, model_path):
    """The actor's worker and the rollout's on one GPU: the engine opens the sender's buffer (no copy through
    the host) and holds exactly the sender's weights."""
    process, channel = _start_sender(tmp_path, model_path, "rollout-9-g", device="cuda")
    engine = HFRolloutEngine.from_pretrained(model_path, dtype="float32", device="cuda")
    kinds = []
    load_bucket = engine.load_bucket
    engine.load_bucket = lambda specs, payload: (kinds.append(payload["kind"]), load_bucket(specs, payload))
    remote = RemoteWeights(lambda: channel, sync="rollout-9-g", version=3, timeout_s=60)
    assert remote.receive_into(engine) >= 4
    remote.finish()
    assert set(kinds) == {"cuda_ipc"}
    expected = _expected(model_path)
    assert all(torch.equal(tensor.cpu(), expected[name]) for name, tensor in engine.model.state_dict().items())
    assert _metrics(process)["weights/streams"] == 1.0


def test_a_senders_thread_polls_at_the_stream_pace_while_a_pull_may_come(monkeypatch):
    """The thread's pauses grow to IDLE_POLL_S when nothing is expected, and shrink to STREAM_POLL_S while the
    send_weights stage waits (wait_done) or a version is published, so that a pull is answered within a few
    milliseconds."""
    real_sleep, pauses = time.sleep, []

    def sleep(seconds: float) -> None:
        if threading.current_thread().name == "rlhf-weights-server":
            pauses.append((time.monotonic(), seconds))
        real_sleep(seconds)

    monkeypatch.setattr(weight_channel.time, "sleep", sleep)
    sender = WeightSender(address="127.0.0.1")
    sender.open()
    try:
        sender.start_thread()
        real_sleep(1.0)
        assert max(pause for _, pause in pauses) == weight_channel.IDLE_POLL_S
        waiting = threading.Thread(target=sender.wait_done, args=("rollout-1-x", 1.5))
        waiting.start()
        real_sleep(0.2)
        began = time.monotonic()
        real_sleep(0.5)
        during = [pause for at, pause in pauses if began <= at]
        assert len(during) > 50 and max(during) <= weight_channel.STREAM_POLL_S, during[:5]
        waiting.join()
        real_sleep(1.0)
        assert pauses[-1][1] == weight_channel.IDLE_POLL_S  # back to idle once the stage is over
        model = torch.nn.Linear(2, 2)
        sender.publish(1, model, torch.float32, 2**20, 5.0)
        real_sleep(0.2)
        assert pauses[-1][1] == weight_channel.STREAM_POLL_S
        sender.withdraw()
        real_sleep(1.0)
        assert pauses[-1][1] == weight_channel.IDLE_POLL_S
    finally:
        sender.close()


def test_a_closed_sender_stops_its_thread_before_it_lets_the_store_go():
    """A thread still in a call of the store when the process ended aborted it (exit code 134, after every test
    had passed); close, which also runs at exit, ends the thread first."""
    sender = WeightSender()
    sender.open()
    sender.publish(1, torch.nn.Linear(2, 2), torch.float32, 2**20, 5.0)  # serving: polls at the stream pace
    thread = sender._thread
    assert thread.is_alive() and sender in _OPEN_SENDERS
    started = time.monotonic()
    sender.close()
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert sender.store is None and sender.channel is None


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (IPv4, dotted) on which a socket of this host listens at `port` (/proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.append(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_the_channels_store_listens_on_its_address_only_and_a_bad_address_is_one_line(monkeypatch, capsys):
    """TCPStore's own server listens on every interface; the channel's listens where the channel file says."""
    monkeypatch.setenv("RLHF_WEIGHTS_ADDRESS", "127.0.0.1")
    sender = WeightSender()
    try:
        channel = sender.open()
        assert channel.address == "127.0.0.1"
        assert _listening_addresses(channel.port) == ["127.0.0.1"]
        weight_channel.connect(channel).set("probe", "1")  # a receiver reaches it at that address
        assert sender.store.get("probe") == b"1"
    finally:
        sender.close()

    # An address of another host, set by hand: one line naming it, before anything listens.
    monkeypatch.setenv("RLHF_WEIGHTS_ADDRESS", "192.0.2.1")  # TEST-NET-1: nobody's address
    with pytest.raises(StreamError, match=r"^RLHF_WEIGHTS_ADDRESS=192\.0\.2\.1: the actor's weights channel cannot "
                                          r"listen there \(.+\); set an address of this host$"):
        WeightSender().open()

    # A host name that resolves to an address this host lacks: the loopback, said once.
    monkeypatch.delenv("RLHF_WEIGHTS_ADDRESS")
    monkeypatch.setattr(weight_channel.socket, "gethostbyname", lambda name: "192.0.2.1")
    sender = WeightSender()
    try:
        channel = sender.open()
        assert channel.address == "127.0.0.1" and _listening_addresses(channel.port) == ["127.0.0.1"]
    finally:
        sender.close()
    assert "this host's name resolves to 192.0.2.1, where it cannot listen" in capsys.readouterr().out
