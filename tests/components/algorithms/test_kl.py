import math

import pytest
import torch

from components.algorithms import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_estimator,
    kl_loss,
    kl_penalty,
    make_kl_controller,
)

LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -0.5]])  # logprobs - ref = 0.5, -1, 0


@pytest.mark.parametrize(
    "names, expected",
    [
        (("k1", "kl"), [0.5, -1.0, 0.0]),
        (("abs",), [0.5, 1.0, 0.0]),
        (("k2", "mse"), [0.125, 0.5, 0.0]),  # 0.5 * d^2
        # d = ref - logp = -0.5, 1, 0:  e^-0.5 + 0.5 - 1 = 0.106531;  e - 2 = 0.718282;  0
        (("k3", "low_var_kl"), [0.106531, 0.718282, 0.0]),
    ],
)
def test_kl_estimators_and_aliases(names, expected):
    for name in names:
        assert kl_penalty(LOGPROBS, REF_LOGPROBS, name)[0].tolist() == pytest.approx(expected, abs=1e-5)


def test_k3_clamps_log_ratio_and_result():
    # d = +30 -> clamp 20 -> e^20 - 21 -> clamp 10;  d = -30 -> clamp -20 -> e^-20 + 19 -> clamp 10
    kl = kl_penalty(torch.tensor([[0.0, 0.0]]), torch.tensor([[30.0, -30.0]]), "k3")
    assert kl[0].tolist() == [10.0, 10.0]


def test_kl_registry_and_unknown_name():
    assert set(KL_ESTIMATORS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}
    with pytest.raises(ValueError, match=r"algorithm\.kl_estimator='k4' is not one of: abs, k1, k2, k3"):
        get_kl_estimator("k4")
    with pytest.raises(ValueError, match=r"actor\.kl_loss_type='k4'"):
        get_kl_estimator("k4", field="actor.kl_loss_type")


def test_apply_kl_penalty_by_hand():
    rewards, metrics = apply_kl_penalty(
        token_level_scores=torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]),
        logprobs=torch.tensor([[0.5, -1.0, 0.0], [1.0, 1.0, 7.0]]),
        ref_logprobs=torch.zeros(2, 3),
        response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        kl_coef=0.1,
        estimator="k1",
    )
    # masked k1 = [[0.5, -1, 0], [1, 1, 0]];  rewards = scores - 0.1 * kl
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 1.9, 0.0]]))
    # per-sequence mean kl: -0.5 / 3 and 2 / 2 -> mean (-1/6 + 1) / 2 = 5/12
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(5 / 12, abs=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_kl_loss_k3_token_mean():
    loss, metrics = kl_loss(logprobs=LOGPROBS, ref_logprobs=REF_LOGPROBS, response_mask=torch.tensor([[1, 1, 0]]))
    # (0.106531 + 0.718282) / 2 = 0.412406
    assert loss.item() == pytest.approx(0.412406, abs=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(0.412406, abs=1e-5)


def test_fixed_controller_never_moves():
    controller = make_kl_controller("fixed", kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert isinstance(controller, FixedKLController) and controller.value == 0.05
    assert set(KL_CONTROLLERS) == {"fixed", "adaptive"}


def test_adaptive_controller_updates_and_resumes():
    controller = make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000)
    assert isinstance(controller, AdaptiveKLController)
    controller.update(current_kl=9.0, n_steps=256)  # error 0.5 -> clip 0.2; x (1 + 0.2 * 256 / 1e4)
    assert controller.value == pytest.approx(0.100512)
    controller.update(current_kl=3.0, n_steps=100)  # error -0.5 -> -0.2; x (1 - 0.2 * 100 / 1e4)
    assert controller.value == pytest.approx(0.100512 * 0.998)
    controller.update(current_kl=6.6, n_steps=1000)  # error 0.1 (unclipped); x (1 + 0.1 * 0.1)
    assert controller.value == pytest.approx(0.100512 * 0.998 * 1.01)
    resumed = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    resumed.load_state_dict(controller.state_dict())
    assert math.isclose(resumed.value, controller.value)


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match="target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0)
    with pytest.raises(ValueError, match=r"kl_ctrl\.type='pid' is not one of: adaptive, fixed"):
        make_kl_controller("pid", kl_coef=0.1)
