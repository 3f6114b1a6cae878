"""Tests for the shared optimisation loop (components/training.py), hand-checked on a linear model."""

import math

import pytest
import torch

from components.training import make_optimizer, run_updates
from components.training import OptimConfig

# y = 0 everywhere; w0 = [1, -2, 0.5]; residuals X @ w0 = [1, -2, 0.5, -0.5]
X = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
Y = torch.zeros(4)
W0 = [1.0, -2.0, 0.5]
# gradient of mean_i (x_i.w - y_i)^2 over all four rows: (2/4) * sum_i r_i x_i = [0.25, -1.25, 0]
FULL_GRAD = [0.25, -1.25, 0.0]
FULL_NORM = math.sqrt(0.25**2 + 1.25**2)


def _linear():
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([W0]))
    return model


def _loss_fn(model, calls=None):
    def micro_loss(indices):
        if calls is not None:
            calls.append(indices.tolist())
        prediction = model(X[indices]).squeeze(-1)
        loss = ((prediction - Y[indices]) ** 2).mean()
        return loss, {"test/mean_index": float(indices.float().mean())}

    return micro_loss


def _constant_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _run(model, optimizer, scheduler, *, mini=4, micro=4, epochs=1, clip=1e6, seed=0, micro_loss=None):
    return run_updates(model=model, optimizer=optimizer, scheduler=scheduler, batch_size=4, mini_batch_size=mini,
                       micro_batch_size=micro, epochs=epochs, grad_clip=clip, seed=seed,
                       micro_loss=micro_loss or _loss_fn(model), prefix="t")


@pytest.mark.parametrize("micro", [4, 1, 3])
def test_grad_norm_is_reported_before_clipping_and_clip_is_applied(micro):
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = _run(model, optimizer, _constant_scheduler(optimizer), micro=micro, clip=0.5)
    assert metrics["t/grad_norm"] == pytest.approx(FULL_NORM, rel=1e-6)
    scale = 0.5 / (FULL_NORM + 1e-6)
    expected = [w - scale * g for w, g in zip(W0, FULL_GRAD)]
    assert model.weight.detach()[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert metrics["t/skipped_steps"] == 0.0
    assert metrics["t/lr"] == 1.0


def test_no_clipping_below_the_threshold():
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = _run(model, optimizer, _constant_scheduler(optimizer), clip=10.0)
    assert metrics["t/grad_norm"] == pytest.approx(FULL_NORM, rel=1e-6)
    expected = [w - 0.1 * g for w, g in zip(W0, FULL_GRAD)]
    assert model.weight.detach()[0].tolist() == pytest.approx(expected, abs=1e-7)


def test_make_optimizer_warmup_first_step_uses_base_over_warmup():
    model = _linear()
    optimizer, scheduler = make_optimizer(model, OptimConfig(lr=0.1, warmup_steps=4, grad_clip=1e6))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)
    metrics = _run(model, optimizer, scheduler)
    # Adam's first step moves each weight by lr * g / (|g| + eps): lr * sign(g) where g != 0
    first_lr = 0.1 / 4
    expected = [W0[0] - first_lr, W0[1] + first_lr, W0[2]]
    assert model.weight.detach()[0].tolist() == pytest.approx(expected, abs=1e-7)
    # the returned lr is the rate the last optimizer step used: base / warmup on the first step
    assert metrics["t/lr"] == pytest.approx(0.1 / 4)
    # four more steps (mini-batches of one): the warm-up is over and the lr stays at the base value
    metrics = _run(model, optimizer, scheduler, mini=1, micro=1)
    assert metrics["t/lr"] == pytest.approx(0.1)


def test_make_optimizer_without_warmup_and_with_weight_decay():
    model = _linear()
    config = OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, betas=(0.8, 0.95), grad_clip=1e6)
    optimizer, scheduler = make_optimizer(model, config)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.1)
    assert tuple(group["betas"]) == (0.8, 0.95)
    assert group["weight_decay"] == 0.5
    _run(model, optimizer, scheduler)
    # decoupled weight decay first (w *= 1 - lr * wd), then the Adam step lr * sign(g)
    decayed = [w * (1 - 0.1 * 0.5) for w in W0]
    expected = [decayed[0] - 0.1, decayed[1] + 0.1, decayed[2]]
    assert model.weight.detach()[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_make_optimizer_skips_frozen_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    optimizer, _ = make_optimizer(model, OptimConfig())
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model[1].parameters()}


def test_epochs_and_mini_batches_cover_every_row():
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = _constant_scheduler(optimizer)
    calls = []
    metrics = _run(model, optimizer, scheduler, mini=2, micro=1, epochs=3, micro_loss=_loss_fn(model, calls))
    assert len(calls) == 12
    for epoch in range(3):
        rows = sorted(sum(calls[epoch * 4 : (epoch + 1) * 4], []))
        assert rows == [0, 1, 2, 3]
    assert scheduler.last_epoch == 6  # one scheduler step per mini-batch
    assert metrics["test/mean_index"] == pytest.approx(1.5)
    assert not model.training
    # the same seed gives the same shuffle
    again = []
    _run(_linear(), optimizer, scheduler, mini=2, micro=1, epochs=3, micro_loss=_loss_fn(_linear(), again))
    assert again == calls


def test_non_finite_mini_batch_is_skipped():
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = _constant_scheduler(optimizer)
    calls = []
    base_loss = _loss_fn(model, calls)

    def micro_loss(indices):
        loss, metrics = base_loss(indices)
        return (loss * float("nan") if 0 in indices.tolist() else loss), metrics

    metrics = _run(model, optimizer, scheduler, mini=2, micro=2, micro_loss=micro_loss)
    assert metrics["t/skipped_steps"] == 1.0
    assert scheduler.last_epoch == 1  # only the finite mini-batch stepped
    # the weights moved by exactly one SGD step on the finite mini-batch's rows
    finite_rows = next(rows for rows in calls if 0 not in rows)
    residuals = [sum(w * x for w, x in zip(W0, X[row].tolist())) for row in finite_rows]
    grad = [sum(2 / 2 * r * X[row, k].item() for r, row in zip(residuals, finite_rows)) for k in range(3)]
    assert model.weight.detach()[0].tolist() == pytest.approx([w - 0.1 * g for w, g in zip(W0, grad)], abs=1e-7)
    assert metrics["t/grad_norm"] == pytest.approx(math.sqrt(sum(g * g for g in grad)), rel=1e-6)


def test_all_mini_batches_skipped_leaves_weights():
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = _constant_scheduler(optimizer)
    base_loss = _loss_fn(model)

    def micro_loss(indices):
        loss, metrics = base_loss(indices)
        return loss * float("inf"), metrics

    metrics = _run(model, optimizer, scheduler, mini=2, micro=1, epochs=2, micro_loss=micro_loss)
    assert metrics["t/skipped_steps"] == 4.0
    assert "t/grad_norm" not in metrics
    assert model.weight.detach()[0].tolist() == W0


def test_row_lengths_group_similar_rows_into_micro_batches_without_changing_the_step():
    calls = []
    model = _linear()
    optimizer, _ = make_optimizer(model, OptimConfig(lr=0.1))
    run_updates(model=model, optimizer=optimizer, scheduler=_constant_scheduler(optimizer), batch_size=4,
                mini_batch_size=4, micro_batch_size=2, epochs=1, grad_clip=1e6, seed=0,
                micro_loss=_loss_fn(model, calls), prefix="t", row_lengths=torch.tensor([5, 100, 7, 90]))
    assert calls == [[1, 3], [2, 0]]  # longest first, whatever the shuffle
    grouped = model.weight.detach().clone()
    model = _linear()
    optimizer, _ = make_optimizer(model, OptimConfig(lr=0.1))
    _run(model, optimizer, _constant_scheduler(optimizer), micro=2)
    torch.testing.assert_close(grouped, model.weight.detach())  # same accumulated gradient, same step
