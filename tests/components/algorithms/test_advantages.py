import pytest
import torch

from components.algorithms import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS_NEEDING_CRITIC,
    compute_gae_raw,
    equal_group_fraction,
    get_advantage_estimator,
    sequence_scores_to_token_rewards,
)

# Six sequences: group a = rows 0, 2, 4 (scores 1, 3, 2), b = rows 1, 5 (0, 4), singleton c = row 3 (5).
GROUP_IDS = ["a", "b", "a", "c", "a", "b"]
GROUP_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
# Row 2's score 3 is split over two tokens; row 1's padded reward 9 must be ignored.
GROUP_REWARDS = torch.tensor([[0.0, 1.0], [0.0, 9.0], [1.0, 2.0], [0.0, 5.0], [0.0, 2.0], [0.0, 4.0]])


def run_group_estimator(name):
    return get_advantage_estimator(name)(
        token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=GROUP_IDS
    )


def test_sequence_scores_land_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    rewards = sequence_scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]


def test_gae_by_hand_with_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # gamma = lam = 0.5, padded token contributes nothing:
    # t2: delta = 1 + 0.5*0 - 3 = -2;              A2 = -2
    # t1: delta = 0 + 0.5*3 - 2 = -0.5;            A1 = -0.5 + 0.25*(-2) = -1
    # t0: delta = 0 + 0.5*2 - 1 = 0;               A0 = 0 + 0.25*(-1) = -0.25
    raw = compute_gae_raw(rewards, values, mask, gamma=0.5, lam=0.5)
    assert raw[0].tolist() == pytest.approx([-0.25, -1.0, -2.0, 0.0])
    advantages, returns = get_advantage_estimator("gae")(
        token_rewards=rewards, response_mask=mask, values=values, gamma=0.5, lam=0.5
    )
    # returns = A_raw + V = -0.25+1, -1+2, -2+3, then 0 on padding
    assert returns[0].tolist() == pytest.approx([0.75, 1.0, 1.0, 0.0])
    # whiten [-0.25, -1, -2]: mean -13/12; deviations 10/12, 1/12, -11/12;
    # unbiased var (100 + 1 + 121) / 144 / 2 = 0.770833, std 0.877971
    expected = [10 / 12 / 0.877971, 1 / 12 / 0.877971, -11 / 12 / 0.877971, 0.0]
    assert advantages[0].tolist() == pytest.approx(expected, abs=1e-4)


def test_gae_without_values_is_a_user_error():
    with pytest.raises(ValueError, match="values"):
        get_advantage_estimator("gae")(token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK)


def test_grpo_normalizes_by_group_mean_and_unbiased_std():
    advantages, returns = run_group_estimator("grpo")
    # a: mean 2, std 1 -> rows 0, 2, 4 get -1, 1, 0;  b: mean 2, std sqrt((4 + 4) / 1) = 2.8284 -> -/+ 0.7071
    # c: singleton keeps mean 0, std 1 -> 5
    per_sequence = [-1.0, -0.70711, 1.0, 5.0, 0.0, 0.70711]
    assert advantages[:, 0].tolist() == pytest.approx(per_sequence, abs=1e-4)
    assert advantages[1, 1].item() == 0.0  # masked token stays zero
    assert torch.equal(advantages, returns)


def test_grpo_no_std_only_subtracts_group_mean():
    advantages, _ = run_group_estimator("grpo_no_std")
    assert advantages[:, 1].tolist() == pytest.approx([-1.0, 0.0, 1.0, 5.0, 0.0, 2.0])
    assert advantages[:, 0].tolist() == pytest.approx([-1.0, -2.0, 1.0, 5.0, 0.0, 2.0])


def test_rloo_uses_leave_one_out_baseline():
    advantages, returns = run_group_estimator("rloo")
    # a (n=3): 1 - mean(3, 2) = -1.5, 3 - mean(1, 2) = 1.5, 2 - mean(1, 3) = 0  (= 1.5 * (s - 2))
    # b (n=2): 0 - 4 = -4, 4 - 0 = 4  (= 2 * (s - 2));  c (n=1): raw score 5
    assert advantages[:, 0].tolist() == pytest.approx([-1.5, -4.0, 1.5, 5.0, 0.0, 4.0])
    assert torch.equal(advantages, returns)


def test_group_estimators_need_matching_group_ids():
    with pytest.raises(ValueError, match="group_ids"):
        get_advantage_estimator("grpo")(token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK)
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        get_advantage_estimator("rloo")(token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, group_ids=["a", "b"])


def test_reinforce_plus_plus_discounts_and_resets_at_mask():
    rewards = torch.tensor([[1.0, 2.0, 4.0, 9.0], [8.0, 0.0, 0.0, 0.0], [1.0, 5.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    advantages, returns = get_advantage_estimator("reinforce_plus_plus")(
        token_rewards=rewards, response_mask=mask, gamma=0.5
    )
    # row 0: G2 = 4, G1 = 2 + 0.5*4 = 4, G0 = 1 + 0.5*4 = 3
    # row 2: G2 = 2, G1 masked -> 0 (reset), G0 = 1 + 0.5*0 = 1
    expected = torch.tensor([[3.0, 4.0, 4.0, 0.0], [8.0, 0.0, 0.0, 0.0], [1.0, 0.0, 2.0, 0.0]])
    torch.testing.assert_close(returns, expected)
    # whiten valid returns [3, 4, 4, 8, 1, 2]: mean 22/6; squared deviations sum 29.3333; var /5 = 5.86667
    std = 5.86667**0.5
    mean = 22 / 6
    assert advantages[0, :3].tolist() == pytest.approx([(3 - mean) / std, (4 - mean) / std, (4 - mean) / std], abs=1e-4)
    assert advantages[2].tolist() == pytest.approx([(1 - mean) / std, 0.0, (2 - mean) / std, 0.0], abs=1e-4)


def test_every_estimator_shares_signature_and_zeroes_padding():
    values = torch.ones_like(GROUP_REWARDS)
    for name in ADVANTAGE_ESTIMATORS:
        advantages, returns = get_advantage_estimator(name)(
            token_rewards=GROUP_REWARDS, response_mask=GROUP_MASK, values=values, group_ids=GROUP_IDS,
            gamma=0.9, lam=0.95, epsilon=1e-6,
        )
        assert advantages.shape == returns.shape == GROUP_REWARDS.shape, name
        assert advantages[1, 1].item() == 0.0 and returns[1, 1].item() == 0.0, name
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "grpo_no_std", "rloo", "reinforce_plus_plus"}
    assert set(ESTIMATORS_NEEDING_CRITIC) == {"gae"}


def test_unknown_estimator_names_field_and_options():
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator='foo' is not one of: gae, grpo, grpo_no_std"):
        get_advantage_estimator("foo")


def test_equal_group_fraction_counts_groups_of_equal_scores_among_groups_of_two_or_more():
    # a: 0, 0, 0 (equal); b: 1, 0 (differ); c: 1, 1 (equal); d: 0.5 alone (left out). 2 of 3 groups equal.
    scores = [0.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 1.0]
    group_ids = ["a", "b", "a", "c", "a", "d", "b", "c"]
    assert equal_group_fraction(scores, group_ids) == pytest.approx(2 / 3)
    # The estimators agree: every sample of an equal group gets advantage 0 from GRPO and RLOO.
    mask = torch.ones(len(scores), 1)
    rewards = torch.tensor(scores).unsqueeze(-1)
    for name in ("grpo", "rloo"):
        advantages, _ = get_advantage_estimator(name)(token_rewards=rewards, response_mask=mask, group_ids=group_ids)
        assert [row for row, group in enumerate(group_ids) if group in "ac" and advantages[row, 0] != 0] == []


def test_equal_group_fraction_is_one_when_every_group_is_equal_and_zero_when_none_is():
    assert equal_group_fraction([0.0] * 8, [0, 0, 0, 0, 1, 1, 1, 1]) == 1.0  # score 0 everywhere: the run
    assert equal_group_fraction([1.0, 1.0, 0.25, 0.25], ["x", "x", "y", "y"]) == 1.0  # equal within, not across
    assert equal_group_fraction([1.0, 0.0, 0.0, 0.25], ["x", "x", "y", "y"]) == 0.0
    assert equal_group_fraction([0.5, 0.5 + 1e-9], ["x", "x"]) == 0.0  # exact: GRPO still sees a difference


def test_equal_group_fraction_of_groups_of_one_sample_is_none():
    """rollout.n=1 (PPO with a critic, often): a lone sample has nothing to compare with, so no group counts
    and the metric is not logged."""
    assert equal_group_fraction([0.0, 0.0, 1.0], ["p0", "p1", "p2"]) is None
    assert equal_group_fraction([0.0, 0.0, 1.0], ["p0", "p0", "p2"]) == 1.0  # only the pair counts
