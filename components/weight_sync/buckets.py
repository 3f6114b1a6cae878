"""A policy's weights as they travel in memory: named compute-dtype tensors, streamed one at a time and
packed into flat buckets of bounded size, so that no second full copy of the model is ever held.

`compute_tensors(model, dtype)` yields (checkpoint name, tensor cast to `dtype`) for every weight of a
live model (a sharded parameter is gathered alone, then dropped); `pack_buckets` packs that stream into
one reusable flat byte buffer of `bucket_bytes`; `PackPlan` does the same for one version after another of
the same model; `unpack_bucket` is the receiving side's inverse (views into the received buffer, no copy).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
    torch.bool)}


class StaleWeightsError(RuntimeError):
    """The in-memory policy was asked for after its model started changing again."""


def compute_tensors(model: torch.nn.Module, dtype: torch.dtype, *, tied_once: bool = True, cast: bool = True,
                    detach: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every parameter and persistent buffer of `model`, in state-dict order and under
    its state-dict names, floating ones cast to `dtype`. A tensor tied to an earlier one (tied embeddings:
    the LM head) is given once, under the first name (the engines tie it back); with `tied_once=False` it
    is given again when the cast made it a tensor of its own, as save_pretrained of a cast state dict
    keeps it (a stored copy is then byte for byte the storage path's). A sharded parameter (DTensor) is
    gathered alone (a collective: every rank iterates). Nothing is copied that needs no cast; with `cast=False`
    nothing is cast either (`pack_buckets(dtype=...)` casts as it packs, with no tensor in between); with
    `detach=False` (and `cast=False`) the tensors are the model's own parameters and buffers (`PackPlan`)."""
    seen: set[tuple[int, tuple]] = set()
    for name, tensor in model.state_dict(keep_vars=not detach).items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.untyped_storage().data_ptr() + local.storage_offset() * local.element_size(),
               tuple(tensor.shape))
        if key in seen and local.numel() and (tied_once or not tensor.is_floating_point() or tensor.dtype == dtype):
            continue
        seen.add(key)
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if detach:
            tensor = tensor.detach()
        yield name, tensor.to(dtype) if cast and tensor.is_floating_point() else tensor


@dataclass
class Bucket:
    """Several tensors packed into one flat byte buffer: `specs` holds (name, dtype, shape, byte offset)."""

    buffer: torch.Tensor
    specs: list[tuple[str, str, list[int], int]] = field(default_factory=list)
    nbytes: int = 0

    def place(self, name: str, dtype: torch.dtype, shape, offset: int, size: int) -> torch.Tensor:
        """Record a tensor of `size` bytes at `offset` (as `_layout` put it); returns its view of the buffer."""
        self.specs.append((name, str(dtype).removeprefix("torch."), list(shape), offset))
        self.nbytes = _aligned(offset + size)
        return self.buffer[offset:offset + size].view(dtype).view(shape)


def _aligned(size: int, alignment: int = 256) -> int:
    return (size + alignment - 1) // alignment * alignment


class BucketBuffers:
    """The flat buffers buckets are packed into, kept from one hand-over to the next (one per device). On a GPU
    each is allocated in a memory pool of its own: its CUDA IPC handle then covers that buffer alone (not a
    large segment of the caching allocator that training left behind), stays the same from one hand-over to
    the next, and a receiver that keeps it open (channel.py) maps it once."""

    def __init__(self):
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._pools: list = []

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < nbytes:
            self._buffers.pop(device, None)
            buffer = self._allocate(nbytes, device)
            self._buffers[device] = buffer
        return buffer

    def _allocate(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and hasattr(torch.cuda, "MemPool"):
            try:
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool, device):
                    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
                self._pools.append(pool)
                return buffer
            except (RuntimeError, TypeError, AttributeError):  # an older torch: the caching allocator's block
                pass
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _layout(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None
            ) -> Iterator[tuple[int, str, torch.Tensor, torch.dtype, int, int, int]]:
    """(bucket index, name, tensor, its dtype in the bucket, byte offset, bytes, the bucket's bytes at least) of
    every tensor as packed: in order, into buckets of at most `bucket_bytes` (a larger tensor gets one of its own,
    a tensor on another device starts a new one), each tensor at a 256-byte boundary."""
    index, used, capacity, device = -1, 0, 0, None
    for name, tensor in tensors:
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        size = tensor.numel() * target.itemsize
        if index < 0 or used + size > capacity or tensor.device != device:
            index, used, capacity, device = index + 1, 0, max(bucket_bytes, size), tensor.device
        yield index, name, tensor, target, used, size, capacity
        used = _aligned(used + size)


def pack_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 buffers: BucketBuffers | None = None, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Pack `tensors` into buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own). One
    buffer is reused (from `buffers`, kept across calls, when given): a bucket is valid until the consumer
    asks for the next one, so a consumer must be done with a bucket (on the GPU too) before it iterates on.
    With `dtype`, floating tensors are cast to it as they are copied in (one kernel per tensor, no cast tensor
    allocated). For one version after another of the same live model, `PackPlan` does the same work in one
    call into torch per bucket."""
    buffers = BucketBuffers() if buffers is None else buffers
    bucket: Bucket | None = None
    current = -1
    for index, name, tensor, target, offset, size, capacity in _layout(tensors, bucket_bytes, dtype):
        if index != current:
            if bucket is not None:
                yield bucket
            bucket, current = Bucket(buffers.get(capacity, tensor.device)), index
        bucket.place(name, target, tensor.shape, offset, size).copy_(tensor)
    if bucket is not None and bucket.specs:
        yield bucket


class PackPlan:
    """The buckets of one live model's tensors (`compute_tensors(..., cast=False, detach=False)`), laid out once
    as `pack_buckets` lays them out, for streaming one version after another: each bucket is then a single
    `torch._foreach_copy_` from the model's tensors into views of the buffer, cast on the way.

    Why: every call into torch lets go of the GIL, and getting it back waits for any other thread of the
    process running Python. Packing tensor by tensor (a state dict, then views and a copy for each tensor)
    makes hundreds of such calls per bucket: on one H200, a bucket of the 0.5B shape then took 30-65 ms of
    wall time for 7-8 ms of the thread's CPU time while the actor's worker took its next stage. The plan holds
    weak references to the model's tensors: it keeps no released model alive."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, buffers: BucketBuffers,
                 dtype: torch.dtype | None):
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self._sources = [weakref.ref(tensor) for _, tensor in tensors]
        self._key = _plan_key(tensors)
        layout = list(_layout(tensors, bucket_bytes, dtype))
        sizes: dict[torch.device, int] = {}
        for _, _, tensor, _, _, _, capacity in layout:
            sizes[tensor.device] = max(sizes.get(tensor.device, 0), capacity)
        shared = {device: buffers.get(nbytes, device) for device, nbytes in sizes.items()}
        self._buckets: list[tuple[Bucket, list[torch.Tensor], list[int]]] = []
        for position, (index, name, tensor, target, offset, size, _) in enumerate(layout):
            if index == len(self._buckets):
                self._buckets.append((Bucket(shared[tensor.device]), [], []))
            bucket, views, sources = self._buckets[index]
            views.append(bucket.place(name, target, tensor.shape, offset, size))
            sources.append(position)

    def fits(self, tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None) -> bool:
        """Whether this plan still packs `tensors` (the same tensor objects, storage and shapes) as asked."""
        return (bucket_bytes == self.bucket_bytes and dtype == self.dtype and len(tensors) == len(self._sources)
                and all(ref() is tensor for ref, (_, tensor) in zip(self._sources, tensors))
                and _plan_key(tensors) == self._key)

    @property
    def available(self) -> bool:
        """Whether every tensor planned from is still alive."""
        return all(ref() is not None for ref in self._sources)

    def buckets(self) -> Iterator[Bucket]:
        """The buckets, each filled as it is asked for (valid until the next one: they share one buffer)."""
        sources = [ref() for ref in self._sources]
        if any(source is None for source in sources):
            raise StaleWeightsError("the model these weights were planned from has been released")
        for bucket, views, positions in self._buckets:
            with torch.no_grad():
                torch._foreach_copy_(views, [sources[position] for position in positions])
            yield bucket


def _plan_key(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple]:
    return [(name, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
            for name, tensor in tensors]


def unpack_bucket(specs: Iterable, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a packed bucket as views into `buffer` (flat uint8), as `pack_buckets` laid them out."""
    unpacked = []
    for name, dtype_name, shape, offset in specs:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"weights bucket: tensor {name!r} has dtype {dtype_name!r}, not one of {sorted(_DTYPES)}")
        count = 1
        for dim in shape:
            count *= int(dim)
        size = count * torch.empty((), dtype=dtype).element_size()
        unpacked.append((name, buffer[offset:offset + size].view(dtype).view(list(shape))))
    return unpacked
