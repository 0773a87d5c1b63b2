"""Exact tests of FedConcat's concatenated model: initialization, freezing, head training, save/load."""

import subprocess
import sys
import textwrap

import pytest
import torch

from torch import nn

from concatfl.core.concat import (
    ConcatModel,
    FeatureCache,
    check_head,
    classifier_from_heads,
    concat_state_dict,
    concatenate,
    is_concat_state,
    load_concat_model,
    num_encoders,
    random_classifier,
    save_concat_model,
    split_model,
    train_classifier,
)
from concatfl.config import RunConfig
from concatfl.models import build_model
from concatfl.runtime import ServerEnv
from concatfl.training import Normalization, evaluate


SHAPE = (1, 8, 8)


def make_mlp():
    return build_model("mlp", SHAPE, 10)


def cluster_models(count: int = 3):
    torch.manual_seed(0)
    return [make_mlp() for _ in range(count)]


def test_head_init_gives_the_sum_of_cluster_logits():
    models = cluster_models()
    states = [model.state_dict() for model in models]
    concat = ConcatModel.from_factory(make_mlp, 3)
    concat.load_state_dict(concat_state_dict(states, classifier_from_heads(states)))
    x = torch.randn(16, *SHAPE)
    with torch.no_grad():
        expected = sum(model(x) for model in models)
        got = concat(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert concat.classifier.weight.shape == (10, 3 * 200)


def test_state_dict_layout():
    states = [model.state_dict() for model in cluster_models(2)]
    state = concat_state_dict(states, classifier_from_heads(states))
    assert num_encoders(state) == 2 and is_concat_state(state)
    assert not is_concat_state(states[0])
    torch.testing.assert_close(state["encoders.1.fc2.weight"], states[1]["encoder.fc2.weight"])
    assert list(state)[-2:] == ["classifier.weight", "classifier.bias"]


class QuickstartNet(nn.Module):
    """A user's model in Flower's quickstart style: own layer names, forward ends with fc3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class SoftmaxAfterHead(QuickstartNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(super().forward(x), dim=1)


def shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def test_check_head_gives_classes_and_feature_dim():
    assert check_head(shapes(make_mlp()), "classifier") == (10, 200)
    assert check_head(shapes(QuickstartNet()), "fc3") == (10, 16)


@pytest.mark.parametrize(
    ("model", "head", "problem"),
    [
        (QuickstartNet(), "classifier", "no 'classifier.weight' or 'classifier.bias'"),
        (QuickstartNet(), "fc", "no 'fc.weight' or 'fc.bias'"),
        (nn.Sequential(nn.Conv2d(1, 2, 3)), "0", "'0.weight' has shape (2, 1, 3, 3)"),
        (nn.Sequential(nn.Linear(4, 3)), "0", "no parameters besides its head '0' (no encoder)"),
    ],
)
def test_check_head_says_what_is_wrong_and_which_layer_looks_like_the_head(model, head, problem):
    with pytest.raises(ValueError) as error:
        check_head(shapes(model), head)
    message = str(error.value)
    assert message.startswith(f"head={head!r}: ") and problem in message
    assert "The model's keys: " + next(iter(model.state_dict())) in message
    if isinstance(model, QuickstartNet):
        assert message.endswith("its last linear layer is 'fc3' (head='fc3')")


def test_split_model_cuts_a_foreign_model_at_its_head():
    torch.manual_seed(0)
    model = QuickstartNet()
    x = torch.randn(5, 64)
    with torch.no_grad():
        expected = model(x)
        features = torch.relu(model.fc2(torch.relu(model.fc1(x))))
    encoder, head = split_model(model, "fc3", x)
    assert head.in_features == 16
    assert set(encoder.state_dict()) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    with torch.no_grad():
        torch.testing.assert_close(encoder(x), features)
        torch.testing.assert_close(head(encoder(x)), expected)


def test_split_model_keeps_concatfls_encoder_submodule():
    model = make_mlp()
    encoder, head = split_model(model, "classifier", torch.rand(3, *SHAPE))
    assert encoder is model.encoder and head is model.classifier


@pytest.mark.parametrize(
    ("model", "head", "message"),
    [
        (SoftmaxAfterHead(), "fc3", "forward must end with `return self.fc3(features)`"),
        (QuickstartNet(), "fc1", "forward must end with `return self.fc1(features)`"),
        (QuickstartNet(), "fc9", "must name the model's last nn.Linear layer; the model has nothing there"),
        (nn.Sequential(nn.Linear(64, 3), nn.ReLU()), "1", "the model has ReLU there"),
    ],
)
def test_split_model_refuses_a_head_the_output_does_not_end_with(model, head, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_model(model, head, torch.randn(3, 64))


def test_foreign_cluster_models_concatenate_to_the_ensemble():
    """Keys keep the user's names under encoders.<k>.; the head from the cluster heads sums
    the cluster models' logits, as for concatfl's own models."""
    torch.manual_seed(1)
    models = [QuickstartNet() for _ in range(3)]
    states = [model.state_dict() for model in models]
    encoders, classifier = concatenate(states, "fc3")
    expected_keys = {f"encoders.{k}.fc{i}.{part}" for k in range(3) for i in (1, 2) for part in ("weight", "bias")}
    assert set(encoders) == expected_keys
    assert set(classifier) == {"classifier.weight", "classifier.bias"}
    concat = ConcatModel.from_factory(QuickstartNet, 3, "fc3")
    concat.load_state_dict({**encoders, **classifier})
    x = torch.randn(8, 64)
    with torch.no_grad():
        torch.testing.assert_close(concat(x), sum(model(x) for model in models), rtol=1e-5, atol=1e-5)
    assert concat.classifier.weight.shape == (10, 3 * 16)


def test_concatenate_draws_a_random_head_from_the_generator():
    states = [model.state_dict() for model in cluster_models(2)]
    encoders, classifier = concatenate(states, random_head=torch.Generator().manual_seed(5))
    weight, bias = random_classifier(400, 10, torch.Generator().manual_seed(5))
    torch.testing.assert_close(classifier["classifier.weight"], weight)
    torch.testing.assert_close(classifier["classifier.bias"], bias)
    torch.testing.assert_close(encoders["encoders.1.fc2.weight"], states[1]["encoder.fc2.weight"])


def test_encoders_are_frozen_and_stay_in_eval_mode():
    concat = ConcatModel.from_factory(make_mlp, 2)
    before = {k: v.clone() for k, v in concat.encoders.state_dict().items()}
    concat.train()
    assert concat.classifier.training and not any(m.training for m in concat.encoders.modules())
    assert all(not p.requires_grad for p in concat.encoders.parameters())
    optimizer = torch.optim.SGD(concat.parameters(), lr=1.0)
    loss = torch.nn.functional.cross_entropy(concat(torch.randn(8, *SHAPE)), torch.arange(8))
    loss.backward()
    optimizer.step()
    assert concat.classifier.weight.grad is not None
    assert all(p.grad is None for p in concat.encoders.parameters())
    for key, value in concat.encoders.state_dict().items():
        torch.testing.assert_close(value, before[key])


def test_random_classifier_is_seeded_and_bounded():
    w1, b1 = random_classifier(400, 10, torch.Generator().manual_seed(5))
    w2, b2 = random_classifier(400, 10, torch.Generator().manual_seed(5))
    torch.testing.assert_close(w1, w2)
    torch.testing.assert_close(b1, b2)
    assert w1.shape == (10, 400) and b1.shape == (10,)
    assert w1.abs().max() <= 1 / 20 and b1.abs().max() <= 1 / 20


def test_train_classifier_takes_the_given_number_of_steps_and_learns():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 2
    features = torch.nn.functional.one_hot(labels, 2).float() * 3 + 0.1 * torch.randn(
        40, 2, generator=generator
    )
    head = torch.nn.Linear(2, 2)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    first = train_classifier(head, features, labels, steps=1, batch_size=8, lr=0.5, generator=generator)
    later = train_classifier(head, features, labels, steps=12, batch_size=8, lr=0.5, generator=generator)
    assert first == pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-5)
    assert later < first
    assert (head(features).argmax(dim=1) == labels).all()


def test_saved_model_loads_back_without_flower(tmp_path):
    states = [model.state_dict() for model in cluster_models(2)]
    concat = ConcatModel.from_factory(make_mlp, 2)
    concat.load_state_dict(concat_state_dict(states, classifier_from_heads(states)))
    path = save_concat_model(
        tmp_path / "m.pt", concat.state_dict(), model_name="mlp", input_shape=SHAPE, mean=[0.3], std=[0.4]
    )
    x = torch.rand(5, *SHAPE)
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        torch.save(concat((x - 0.3) / 0.4), tmp_path / "expected.pt")
    # A fresh interpreter in which importing flwr fails: loading and inference need torch only.
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["flwr"] = None
        import torch
        from concatfl.core.concat import load_concat_model
        model, meta = load_concat_model({str(path)!r})
        x = torch.load({str(tmp_path / "x.pt")!r})
        mean, std = meta["mean"][0], meta["std"][0]
        with torch.no_grad():
            torch.testing.assert_close(model((x - mean) / std), torch.load({str(tmp_path / "expected.pt")!r}))
        assert meta["num_encoders"] == 2 and meta["model"] == "mlp" and meta["num_classes"] == 10
        assert not any(name.startswith("flwr") and mod is not None for name, mod in sys.modules.items())
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    model, meta = load_concat_model(path)
    assert meta["input_shape"] == list(SHAPE) and not model.training


def _concat(count: int = 2) -> ConcatModel:
    states = [model.state_dict() for model in cluster_models(count)]
    concat = ConcatModel.from_factory(make_mlp, count)
    concat.load_state_dict(concat_state_dict(states, classifier_from_heads(states)))
    return concat


def test_feature_cache_recomputes_only_when_encoders_or_inputs_change():
    concat, cache = _concat(), FeatureCache()
    x, other = torch.rand(10, *SHAPE), torch.rand(10, *SHAPE)
    double = lambda batch: 2 * batch  # noqa: E731  (the normalization stand-in)
    in_batches = lambda: torch.cat([concat.features(2 * x[i : i + 4]) for i in (0, 4, 8)])  # noqa: E731
    features = cache.features(concat, x, double, torch.device("cpu"), batch_size=4)
    assert torch.equal(features, in_batches())
    with torch.no_grad():
        concat.classifier.weight.add_(1.0)  # a classifier round: the same encoders
    assert cache.features(concat, x, double, torch.device("cpu"), batch_size=4) is features
    with torch.no_grad():
        next(concat.encoders[1].parameters()).add_(1e-3)  # another encoder round
    changed = cache.features(concat, x, double, torch.device("cpu"), batch_size=4)
    assert changed is not features and not torch.equal(changed, features)
    assert torch.equal(changed, in_batches())
    assert not torch.equal(cache.features(concat, other, double, torch.device("cpu")), changed)


def test_head_on_cached_features_evaluates_exactly_like_the_concat_model():
    concat, cache = _concat(3), FeatureCache()
    x, y = torch.rand(23, *SHAPE), torch.randint(0, 10, (23,))
    normalization = Normalization([0.5], [0.25])
    cpu = torch.device("cpu")
    expected = evaluate(concat, x, y, normalization=normalization, device=cpu, batch_size=8)
    features = cache.features(concat, x, normalization, cpu, batch_size=8)
    assert evaluate(concat.classifier, features, y, normalization=None, device=cpu, batch_size=8) == expected


def test_server_evaluation_of_a_concat_model_reuses_features_across_heads():
    env = ServerEnv.from_config(RunConfig.from_mapping({"device": "cpu"}))
    models = [env.make_model() for _ in range(2)]
    states = [model.state_dict() for model in models]
    concat = ConcatModel.from_factory(env.make_model, 2)
    concat.load_state_dict(concat_state_dict(states, classifier_from_heads(states)))
    encoder_passes = []
    concat.encoders[0].register_forward_hook(lambda *_: encoder_passes.append(1))
    for head in range(3):
        passes = len(encoder_passes)
        assert env.evaluate(concat) == evaluate(
            concat, env.eval_x, env.eval_y, normalization=env.normalization, device=env.device
        )
        # the first evaluation computes the features, the later ones only run the head
        assert len(encoder_passes) - passes == (2 if head == 0 else 1)  # + the reference evaluation's one
        with torch.no_grad():
            concat.classifier.bias.add_(torch.linspace(-1, 1, 10))
