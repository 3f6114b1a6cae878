import pytest
import torch

from components.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    get_loss_aggregation,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
RAGGED_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum_and_mean_all_and_per_row():
    # valid values: 1, 2 | 4  ->  total 7 over 3 tokens
    assert masked_sum(VALUES, RAGGED_MASK).item() == pytest.approx(7.0)
    assert masked_sum(VALUES, RAGGED_MASK, dim=-1).tolist() == pytest.approx([3.0, 4.0])
    assert masked_mean(VALUES, RAGGED_MASK).item() == pytest.approx(7.0 / 3.0)
    assert masked_mean(VALUES, RAGGED_MASK, dim=-1).tolist() == pytest.approx([1.5, 4.0])


def test_masked_mean_accepts_bool_mask_and_empty_mask_gives_zero():
    assert masked_mean(VALUES, RAGGED_MASK.bool()).item() == pytest.approx(7.0 / 3.0)
    assert masked_mean(VALUES, torch.zeros_like(VALUES)).item() == 0.0


def test_masked_var_unbiased_and_biased():
    values = torch.tensor([[1.0, 2.0, 4.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9; biased 14/9; unbiased 42/9 / 2 = 7/3
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14.0 / 9.0)
    assert masked_var(values, mask).item() == pytest.approx(7.0 / 3.0)


def test_masked_whiten_with_and_without_shift():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # mean 2; unbiased var (1 + 1) / 1 = 2  ->  (v - 2) / sqrt(2)
    root_two = 2.0**0.5
    assert masked_whiten(values, mask)[0, :2].tolist() == pytest.approx([-1 / root_two, 1 / root_two], abs=1e-5)
    unshifted = masked_whiten(values, mask, shift_mean=False)[0, :2]
    assert unshifted.tolist() == pytest.approx([2 - 1 / root_two, 2 + 1 / root_two], abs=1e-5)


def test_aggregation_modes_on_ragged_mask():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 tokens
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-sum: per-seq sums 6, 4, 0 -> mean over 3 sequences
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(10.0 / 3.0)
    # seq-mean-token-mean: per-seq means 2, 4, 0 (empty sequence divides by 1) -> 6 / 3
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert set(LOSS_AGGREGATIONS) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean"}


def test_unknown_aggregation_names_field_and_options():
    with pytest.raises(ValueError, match=r"actor\.loss_agg_mode='bogus' is not one of: seq-mean-token-mean"):
        get_loss_aggregation("bogus")
    with pytest.raises(ValueError, match=r"critic\.loss_agg_mode='bogus'.*token-mean"):
        get_loss_aggregation("bogus", field="critic.loss_agg_mode")
