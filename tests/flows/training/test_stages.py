"""flows.training.stages: stage-level guards that need no model."""

import math

import pytest
import torch

from flows.training.stages import check_finite


def test_check_finite_names_the_stage_the_quantity_and_the_samples():
    values = torch.tensor([[0.0, 1.0], [math.nan, 0.0], [0.0, math.inf]])
    with pytest.raises(FloatingPointError) as error:
        check_finite("advantages", 3, "the advantage", values, ["s3-p0-n0", "s3-p0-n1", "s3-p1-n0"])
    message = str(error.value)
    assert "stage advantages at step 3" in message and "the advantage" in message
    assert "2 sample(s): s3-p0-n1, s3-p1-n0" in message and "s3-p0-n0" not in message


def test_check_finite_accepts_finite_values():
    check_finite("advantages", 0, "the reward", torch.zeros(2, 3), ["a", "b"])
