"""flows.roles: where the rollout's vLLM engines go (rollout.engines), by hand."""

from __future__ import annotations

import pytest

from flows.roles import engine_placements


def test_one_engine_per_gpu_group():
    assert engine_placements(2, 1, 2, "4,6") == [("4", 1), ("6", 1)]
    assert engine_placements(2, 2, 4, None) == [("0,1", 1), ("2,3", 1)]


def test_more_engines_than_groups_share_them_round_robin():
    assert engine_placements(2, 1, 1, "3") == [("3", 2), ("3", 2)]
    assert engine_placements(3, 1, 2, "4,6") == [("4", 2), ("6", 1), ("4", 2)]


def test_a_tensor_parallel_size_beyond_the_gpus_is_refused():
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2: only 1 GPUs"):
        engine_placements(1, 2, 1, None)
