"""components.weight_sync.buckets: the in-memory weight stream packs into bounded buckets and unpacks to the
same tensors, gives tied tensors once, and a plan packs version after version what pack_buckets would."""

from __future__ import annotations

import pytest
import torch

from components.weight_sync.buckets import (BucketBuffers, PackPlan, StaleWeightsError, compute_tensors, pack_buckets,
                                            unpack_bucket)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def test_tied_tensors_are_given_once_cast_and_buffers_kept():
    model = _Tied()
    streamed = dict(compute_tensors(model, torch.bfloat16))
    assert list(streamed) == ["steps", "embed.weight", "norm.weight", "norm.bias"]  # head.weight: tied
    assert streamed["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(streamed["embed.weight"], model.embed.weight.detach().to(torch.bfloat16))
    assert streamed["steps"].dtype == torch.int64 and streamed["steps"].tolist() == [3, 4]
    # A stored copy keeps the head when the cast made it a tensor of its own (as save_pretrained does),
    # not when it would share the embedding's storage.
    assert "head.weight" in dict(compute_tensors(model, torch.bfloat16, tied_once=False))
    assert "head.weight" not in dict(compute_tensors(model, torch.float32, tied_once=False))


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 10_000])
def test_buckets_unpack_to_the_same_tensors_at_any_bucket_size(bucket_bytes):
    generator = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=generator).to(torch.bfloat16)),
               ("b", torch.randn(7, generator=generator)),
               ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
               ("d", torch.randn(4, 4, generator=generator).t())]  # not contiguous
    received = []
    for bucket in pack_buckets(iter(tensors), bucket_bytes):
        assert bucket.nbytes <= max(bucket_bytes, *(t.numel() * t.element_size() for _, t in tensors)) + 255
        # what crosses to the engine: plain data, then views into the receiver's own buffer
        data = bucket.buffer[:bucket.nbytes].numpy().tobytes()
        received += [(name, tensor.clone()) for name, tensor in
                     unpack_bucket(bucket.specs, torch.frombuffer(bytearray(data), dtype=torch.uint8))]
    assert [name for name, _ in received] == ["a", "b", "c", "d"]
    for (name, sent), (_, got) in zip(tensors, received):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent), name
    if bucket_bytes == 10_000:  # everything fits: one bucket
        assert len(list(pack_buckets(iter(tensors), bucket_bytes))) == 1


@pytest.mark.parametrize("bucket_bytes", [1, 10_000])
def test_buckets_cast_as_they_pack_hold_what_casting_first_would(bucket_bytes):
    """pack_buckets(dtype=...) on uncast tensors: the same bytes and specs as packing tensors cast first
    (floating ones only; integers keep their dtype), strided sources included."""
    model = _Tied()
    with torch.no_grad():
        model.embed.weight.copy_(torch.randn(10, 4, generator=torch.Generator().manual_seed(1)) * 1.2345)
    extra = [("strided", torch.randn(4, 6, generator=torch.Generator().manual_seed(2)).t())]

    cast_first = _unpacked(pack_buckets(iter([*compute_tensors(model, torch.bfloat16),
                                           *[(n, t.to(torch.bfloat16)) for n, t in extra]]), bucket_bytes))
    cast_in = _unpacked(pack_buckets(iter([*compute_tensors(model, torch.bfloat16, cast=False), *extra]), bucket_bytes,
                                  dtype=torch.bfloat16))
    assert [specs for specs, _ in cast_in] == [specs for specs, _ in cast_first]
    assert all(torch.equal(a, b) for (_, got), (_, want) in zip(cast_in, cast_first) for a, b in zip(got, want))
    dtypes = {name: dtype for specs, _ in cast_in for name, dtype, _, _ in specs}
    assert dtypes == {"steps": "int64", "embed.weight": "bfloat16", "norm.weight": "bfloat16",
                      "norm.bias": "bfloat16", "strided": "bfloat16"}


def _unpacked(buckets):  # each bucket's specs and tensors (not the alignment padding, which is never written)
    return [(bucket.specs, [tensor.clone() for _, tensor in unpack_bucket(bucket.specs, bucket.buffer)])
            for bucket in buckets]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 10_000])
def test_a_plan_packs_version_after_version_what_pack_buckets_would_in_one_torch_call_per_bucket(
        bucket_bytes, monkeypatch):
    model = _Tied()
    plan = PackPlan(list(compute_tensors(model, torch.bfloat16, cast=False, detach=False)), bucket_bytes, BucketBuffers(),
                    torch.bfloat16)
    calls = []
    copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *args, **kwargs: calls.append(1) or copy(*args, **kwargs))
    for seed in (1, 2):  # the optimizer changes the weights in place: the same plan packs the new values
        with torch.no_grad():
            model.embed.weight.copy_(torch.randn(10, 4, generator=torch.Generator().manual_seed(seed)) * 1.2345)
            model.norm.bias.add_(seed)
        want = _unpacked(pack_buckets(compute_tensors(model, torch.bfloat16, cast=False), bucket_bytes,
                                      dtype=torch.bfloat16))
        calls.clear()
        got = _unpacked(plan.buckets())
        assert [specs for specs, _ in got] == [specs for specs, _ in want]
        assert all(torch.equal(a, b) for (_, g), (_, w) in zip(got, want) for a, b in zip(g, w))
        assert len(calls) == len(want)  # one call into torch per bucket
    assert got[0][1][0].dtype == torch.int64  # steps: integers keep their dtype


def test_a_plan_fits_only_the_same_tensors_and_keeps_no_released_model_alive():
    import gc
    import weakref

    model = _Tied()
    tensors = list(compute_tensors(model, torch.float32, cast=False, detach=False))
    plan = PackPlan(tensors, 64, BucketBuffers(), torch.bfloat16)
    assert plan.available and plan.fits(list(compute_tensors(model, torch.float32, cast=False, detach=False)), 64, torch.bfloat16)
    assert not plan.fits(tensors, 128, torch.bfloat16) and not plan.fits(tensors, 64, torch.float16)
    model.norm.weight = torch.nn.Parameter(torch.ones(4))  # a new tensor object (e.g. a model reloaded)
    assert not plan.fits(list(compute_tensors(model, torch.float32, cast=False, detach=False)), 64, torch.bfloat16)
    weight = weakref.ref(model.embed.weight)
    del model, tensors
    gc.collect()
    assert weight() is None and not plan.available  # the plan held the model's tensors weakly
    with pytest.raises(StaleWeightsError, match="released"):
        next(plan.buckets())


def test_an_unknown_dtype_in_a_bucket_is_refused_by_name():
    with pytest.raises(ValueError, match="tensor 'x' has dtype 'complex64'"):
        unpack_bucket([("x", "complex64", [1], 0)], torch.zeros(8, dtype=torch.uint8))
