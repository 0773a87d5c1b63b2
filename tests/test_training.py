"""training.py: the proximal term by hand, SGD on a separable set, exact evaluation, devices."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from concatfl.training import Normalization, evaluate, pick_device, proximal_regularizer, train

IDENTITY = Normalization((0.0,), (1.0,))
CPU = torch.device("cpu")


def _linear(weight, bias) -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(len(weight[0]), len(weight)))
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor(weight, dtype=torch.float32))
        model[1].bias.copy_(torch.tensor(bias, dtype=torch.float32))
    return model


def _images(rows) -> torch.Tensor:
    """(N, 1, 1, F) images from a list of feature rows."""
    return torch.tensor(rows, dtype=torch.float32)[:, None, None, :]


# ----------------------------------------------------------------------------- proximal term


def test_proximal_regularizer_equals_half_mu_times_squared_distance_by_hand():
    reference = _linear([[1.0, 2.0], [3.0, 4.0]], [0.5, -0.5])
    model = _linear([[1.0, 0.0], [3.0, 5.0]], [1.5, -0.5])
    # differences: weight (0, -2, 0, 1), bias (1, 0) → squared sum 4 + 1 + 1 = 6
    term = proximal_regularizer(reference, mu=0.3)
    assert term(model).item() == pytest.approx(0.3 / 2 * 6.0)
    assert term(reference).item() == 0.0


def test_proximal_regularizer_anchors_are_a_frozen_copy():
    reference = _linear([[1.0, 2.0]], [0.0])
    term = proximal_regularizer(reference, mu=2.0)
    with torch.no_grad():
        reference[1].weight.add_(10.0)  # moving the reference afterwards must not move the anchors
    assert term(reference).item() == pytest.approx(2.0 / 2 * (2 * 10.0**2))


def test_proximal_regularizer_gradient_is_mu_times_difference():
    reference = _linear([[1.0, 2.0]], [0.0])
    model = _linear([[2.0, 2.0]], [-1.0])
    proximal_regularizer(reference, mu=0.5)(model).backward()
    assert torch.allclose(model[1].weight.grad, torch.tensor([[0.5, 0.0]]))
    assert torch.allclose(model[1].bias.grad, torch.tensor([-0.5]))


# ----------------------------------------------------------------------------- train


def _separable(n: int = 64):
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.randn(n, 2, generator=generator) * 0.3
    x[:, 0] += torch.where(y == 1, 2.0, -2.0)
    return x[:, None, None, :], y


def test_train_reduces_loss_on_a_separable_dataset():
    x, y = _separable()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 2))
    before, _ = evaluate(model, x, y, normalization=IDENTITY, device=CPU)
    mean_loss = train(model, x, y, epochs=20, batch_size=8, lr=0.5, normalization=IDENTITY, device=CPU,
                      generator=torch.Generator().manual_seed(1))
    after, accuracy = evaluate(model, x, y, normalization=IDENTITY, device=CPU)
    assert math.isfinite(mean_loss)
    assert after < 0.2 * before
    assert accuracy == 1.0


def test_train_is_deterministic_given_the_generator():
    x, y = _separable()
    states = []
    for _ in range(2):
        model = _linear([[0.1, -0.2], [0.3, 0.0]], [0.0, 0.0])
        train(model, x, y, epochs=2, batch_size=5, lr=0.1, normalization=IDENTITY, device=CPU,
              generator=torch.Generator().manual_seed(42))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_train_single_full_batch_step_matches_hand_computed_sgd():
    x, y = _separable(8)
    model = _linear([[0.1, -0.2], [0.3, 0.0]], [0.0, 0.0])
    expected = _linear([[0.1, -0.2], [0.3, 0.0]], [0.0, 0.0])
    loss = nn.functional.cross_entropy(expected(x), y)
    loss.backward()
    with torch.no_grad():
        for p in expected.parameters():
            p -= 0.1 * p.grad
    returned = train(model, x, y, epochs=1, batch_size=8, lr=0.1, normalization=IDENTITY, device=CPU,
                     generator=torch.Generator().manual_seed(0))
    assert returned == pytest.approx(loss.item())
    for got, want in zip(model.parameters(), expected.parameters()):
        assert torch.allclose(got, want, atol=1e-6)


def test_train_adds_the_regularizer_to_the_loss():
    x, y = _separable(8)
    model = _linear([[0.1, -0.2], [0.3, 0.0]], [0.0, 0.0])
    plain = nn.functional.cross_entropy(model(x), y).item()
    loss = train(model, x, y, epochs=1, batch_size=8, lr=0.0, normalization=IDENTITY, device=CPU,
                 generator=torch.Generator().manual_seed(0), regularizer=lambda m: torch.tensor(3.0))
    assert loss == pytest.approx(plain + 3.0, rel=1e-5)


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_exact_accuracy_and_loss_for_a_hand_made_model():
    model = _linear([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0])  # predicts the larger feature
    x = _images([[2.0, 0.0], [0.0, 3.0], [1.0, 0.5], [0.2, 0.1], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 0, 1])  # third sample is wrong → 4/5
    loss, accuracy = evaluate(model, x, y, normalization=IDENTITY, device=CPU, batch_size=2)
    logits = x.flatten(1)
    expected_loss = float(nn.functional.cross_entropy(logits, y))
    assert accuracy == 0.8
    assert loss == pytest.approx(expected_loss, rel=1e-6)


def test_evaluate_applies_the_normalization():
    model = _linear([[1.0], [-1.0]], [0.0, 0.0])  # class 0 iff normalized input > 0
    x = _images([[0.2], [0.8]])
    y = torch.tensor([1, 0])
    _, accuracy = evaluate(model, x, y, normalization=Normalization((0.5,), (0.1,)), device=CPU)
    assert accuracy == 1.0
    _, unnormalized = evaluate(model, x, y, normalization=IDENTITY, device=CPU)
    assert unnormalized == 0.5


def test_evaluate_on_empty_set_is_zero():
    model = _linear([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0])
    assert evaluate(model, torch.zeros(0, 1, 1, 2), torch.zeros(0, dtype=torch.long),
                    normalization=IDENTITY, device=CPU) == (0.0, 0.0)


# ----------------------------------------------------------------------------- devices


def test_pick_device_cuda_raises_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        pick_device("cuda")


def test_pick_device_auto_and_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")


def test_pick_device_auto_prefers_cuda_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == torch.device("cuda")
    assert pick_device("cuda") == torch.device("cuda")


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 5e-4), (0.5, 1e-2)])
def test_sgd_gives_torch_optims_weights_bit_for_bit(momentum, weight_decay):
    from concatfl.core.sgd import SGD

    def run(make_optimizer) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        model[2].bias.requires_grad_(False)  # a parameter without a gradient is skipped
        optimizer = make_optimizer([p for p in model.parameters()])
        data = torch.Generator().manual_seed(1)
        for _ in range(7):
            x, y = torch.randn(5, 6, generator=data), torch.randint(0, 3, (5,), generator=data)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    ours = run(lambda params: SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay))
    torchs = run(lambda params: torch.optim.SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay))
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
