"""The primitives of a weights stream between processes (sender.py has the protocol):
where a sender listens (`Channel`), process groups made over its store (`make_group`: NCCL or gloo, apart
from any default group of the process, e.g. vLLM's own), and a bucket's payload as plain data, opened on the
receiving side (`open_payload`): a CUDA IPC handle of the sender's buffer, a broadcast of a group, or bytes.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

IPC_KIND, COLLECTIVE_KIND = "cuda_ipc", "collective"


class StreamError(RuntimeError):
    """The stream broke: the other side went away or went silent."""


@dataclass(frozen=True)
class Channel:
    """Where a sender listens (`address`, on this one only: `listen`); `token` goes with every message."""

    host: str
    address: str
    port: int
    token: str
    pid: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Channel":
        fields = json.loads(text)
        return cls(host=str(fields["host"]), address=str(fields["address"]), port=int(fields["port"]),
                   token=str(fields["token"]), pid=int(fields["pid"]))


def default_address() -> str:
    """This host's address for other hosts: RLHF_WEIGHTS_ADDRESS, else what its name resolves to."""
    configured = os.environ.get("RLHF_WEIGHTS_ADDRESS")
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def listen(address: str | None = None) -> tuple[str, int]:
    """(address, fd) of a socket listening on one address of this host only, for a channel's store: `address`,
    else default_address(). A store of its own would listen on every interface. An address set by hand
    (RLHF_WEIGHTS_ADDRESS) that is not this host's fails here, saying so; a host name that resolves to an address
    this host does not have falls back to the loopback, for receivers on this host only."""
    configured = address or os.environ.get("RLHF_WEIGHTS_ADDRESS")
    chosen = configured or default_address()
    try:
        return chosen, _listening_fd(chosen)
    except OSError as error:
        if configured:
            raise StreamError(f"RLHF_WEIGHTS_ADDRESS={chosen}: the actor's weights channel cannot listen there "
                              f"({error.strerror or error}); set an address of this host") from None
        print(f"weights channel: this host's name resolves to {chosen}, where it cannot listen "
              f"({error.strerror or error}); listening on 127.0.0.1, for rollouts on this host only "
              "(RLHF_WEIGHTS_ADDRESS sets the address other hosts reach)", flush=True)
        return "127.0.0.1", _listening_fd("127.0.0.1")


def _listening_fd(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, 0), family=family, backlog=128)
    return listener.detach()  # the store owns it from now on


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(value, 0.001))


def connect(channel: Channel, timeout_s: float = 10.0):
    """A client of the channel's store (StreamError when it cannot be reached)."""
    try:
        return torch.distributed.TCPStore(channel.address, channel.port, is_master=False,
                                          timeout=seconds(timeout_s))
    except RuntimeError as error:
        raise StreamError(f"cannot reach the actor's weights channel at {channel.address}:{channel.port} "
                          f"({error.__class__.__name__})") from error


def make_group(channel: Channel, prefix: str, rank: int, world: int, backend: str, timeout_s: float, store=None):
    """A process group of `world` ranks over the channel's store under `prefix` (independent of any default
    group of the process, e.g. vLLM's own): gloo or nccl."""
    store = connect(channel) if store is None else store
    prefixed = torch.distributed.PrefixStore(prefix, store)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = seconds(timeout_s)
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, world, options)
    return torch.distributed.ProcessGroupGloo(prefixed, rank, world, seconds(timeout_s))


def broadcast(group, tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` into every rank's `tensor` (in place)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


def encode_share(share: tuple) -> list:
    return [{"hex": item.hex()} if isinstance(item, bytes) else item for item in share]


def decode_share(share: list) -> list:
    return [bytes.fromhex(item["hex"]) if isinstance(item, dict) else item for item in share]


def ipc_payload(buffer: torch.Tensor, nbytes: int) -> dict:
    """A CUDA buffer as plain data another process on its GPU opens (`open_payload`)."""
    torch.cuda.current_stream(buffer.device).synchronize()  # the packing copies are done
    share = buffer.untyped_storage()._share_cuda_()
    return {"kind": IPC_KIND, "device_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
            "share": list(share), "offset": buffer.storage_offset(), "nbytes": nbytes}


def visible_gpu(uuid_text: str) -> int | None:
    """This process's index of the GPU `uuid_text`, or None when it does not see it."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid_text:
            return index
    return None


def gpu_uuids() -> list[str]:
    """The GPUs this process sees."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(index).uuid) for index in range(torch.cuda.device_count())]


class GroupReceiver:
    """A loading process's side of collective buckets: its groups (by prefix) and one reusable buffer."""

    def __init__(self):
        self.groups: dict[str, object] = {}
        self._buffer: torch.Tensor | None = None

    def join(self, channel: dict, prefix: str, rank: int, world: int, backend: str, timeout_s: float) -> None:
        if prefix not in self.groups:
            self.groups[prefix] = make_group(Channel(**channel), prefix, rank, world, backend, timeout_s)

    def receive(self, payload: dict) -> torch.Tensor:
        """A collective bucket's bytes, broadcast by the sender into this process's reusable buffer (on its
        current GPU under NCCL, on the host under gloo)."""
        group = self.groups.get(payload["group"])
        if group is None:
            raise StreamError(f"weights bucket for group {payload['group']!r}, which this process has not joined")
        nbytes = int(payload["nbytes"])
        device = (torch.device("cuda", torch.cuda.current_device()) if payload.get("backend") == "nccl"
                  else torch.device("cpu"))
        if self._buffer is None or self._buffer.device != device or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, int(payload.get("capacity", nbytes))), dtype=torch.uint8,
                                       device=device)
        received = self._buffer[:nbytes]
        broadcast(group, received)
        return received


_OPENED: dict[tuple, torch.UntypedStorage] = {}
"""The senders' buffers this process has opened (newest last, a few kept): a sender that keeps its buffer
(buckets.BucketBuffers) shares the same handle every time, which is then mapped once."""
_OPENED_KEPT = 4


def _opened_storage(device_uuid: str, share: list) -> torch.UntypedStorage:
    key = (device_uuid, *(item for item in share[1:6]))  # handle, size, offset, ref counter (not the event)
    storage = _OPENED.pop(key, None)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_cuda(*share)
    _OPENED[key] = storage
    while len(_OPENED) > _OPENED_KEPT:
        _OPENED.pop(next(iter(_OPENED)))
    return storage


def open_payload(payload: dict, groups: GroupReceiver | None) -> tuple[torch.Tensor, bool]:
    """A bucket's flat bytes from its payload: (buffer, whether it is the sender's or a reused buffer that the
    next bucket overwrites: a loader that keeps tensors past this bucket must copy them)."""
    kind = payload["kind"]
    if kind == IPC_KIND:
        index = visible_gpu(payload["device_uuid"])
        if index is None:
            raise StreamError(f"GPU {payload['device_uuid']} is not visible in this process")
        share = decode_share(payload["share"]) if any(isinstance(item, dict) for item in payload["share"]) \
            else list(payload["share"])
        share[0] = index
        with torch.cuda.device(index):
            storage = _opened_storage(payload["device_uuid"], share)
            received = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
            received.set_(storage, payload["offset"], (payload["nbytes"],), (1,))
        return received, True
    if kind == COLLECTIVE_KIND:
        if groups is None:
            raise StreamError("a collective weights bucket reached a process without a group")
        return groups.receive(payload), True
    if kind == "bytes":
        return torch.frombuffer(bytearray(payload["data"]), dtype=torch.uint8), False
    raise ValueError(f"unknown weights payload kind {kind!r}")


IDLE_POLL_S = 0.05
"""The longest pause between two polls of a key that may be long in coming (a sender's idle queue)."""
STREAM_POLL_S = 0.002
"""The longest pause while a hand-over is under way or may come (its buckets and acks; a sender's queue while it
serves a version): on one H200 (0.5B shape), with 50 ms pauses the rollout waited 0.014-0.051 s for the answer
of the sender's thread."""


def poll(store, key: str, deadline: float, check: Callable[[], None] | None = None,
         max_pause: Callable[[], float] = lambda: IDLE_POLL_S) -> bytes:
    """The value of `key` once it is set: polled with a growing pause (1 ms up to `max_pause()`, asked every
    time), so that a bucket's ack costs about a round trip, without the store's timeout warnings. `check`
    runs between polls and may raise; TimeoutError at `deadline`; StreamError when the store is gone."""
    pause = 0.001
    while True:
        try:
            if store.check([key]):
                return store.get(key)
        except RuntimeError as error:  # DistNetworkError: the store's process is gone
            raise StreamError(f"the weights channel closed while waiting for {key!r}: {error}") from error
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {key!r} on the weights channel in time")
        if check is not None:
            check()
        time.sleep(min(pause, max_pause()))
        pause = min(pause * 1.5, 1.0)
