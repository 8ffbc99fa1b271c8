"""ConfTS: the squared gap between the batch's APS threshold and each true label's APS score, and
the temperature it trains -- the only parameter, folded into the classifier layer when saved."""

import math

import pytest
import torch
from torch import nn

from dpsm_ray.cards import build_model
from dpsm_ray.cards import build_objective
from dpsm_ray.objectives import ConfTS, TemperatureScaledLinear
from dpsm_ray.objectives.confts import classifier_layer
from dpsm_ray.train import LocalEnv, TrainConfig, train


def confts(alpha=0.1):
    return build_objective("confts", alpha=alpha, conformal_weight=0.5)


def binary_logits(true_probabilities):
    """Logits log p, log(1 - p) of two classes, the true label 0: softmax gives back p."""
    p = torch.tensor(true_probabilities, dtype=torch.float64)
    return torch.stack([p.log(), (1 - p).log()], dim=1), torch.zeros(len(true_probabilities), dtype=torch.long)


def test_loss_and_temperature_gradient_by_hand():
    """Two classes: a true label ranked first has the APS score p_y, one ranked second 1.  B1's
    scores 0.9, 1, 0.6, 0.7, 0.95; at alpha 0.4 the conformal rank is ceil(6 * 0.6) = 4 of 5, so
    tau = 0.95.  B2's scores 0.8 and 0.6: the loss is ((0.95 - 0.8)^2 + (0.95 - 0.6)^2) / 2."""
    x1, y1 = binary_logits([0.9, 0.3, 0.6, 0.7, 0.95])
    x2, y2 = binary_logits([0.8, 0.6])
    model = nn.Sequential(nn.Linear(2, 2, dtype=torch.float64))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
        model[0].bias.zero_()
    objective = confts(alpha=0.4)
    objective.attach(model, (2,))
    out = objective(model(x1), y1, model(x2), y2)
    assert out.stats["quantile"].item() == pytest.approx(0.95)
    assert out.loss.item() == pytest.approx(0.0725) == out.stats["upper"].item()
    out.loss.backward()
    # d/d(log T) at T = 1: a first-ranked score sigmoid(d / T), d = log(p / (1 - p)), moves by
    # -p (1 - p) d; a second-ranked one (1) does not move.  tau is B1's 0.95.
    moves = lambda p: -p * (1 - p) * math.log(p / (1 - p))
    by_hand = sum(2 * (0.95 - s) * (moves(0.95) - moves(s)) for s in (0.8, 0.6)) / 2
    assert objective.layer.log_temperature.grad.item() == pytest.approx(by_hand, rel=1e-9)
    assert model[0].weight.grad is None and model[0].bias.grad is None  # the network is frozen


def aps_by_hand(probabilities, label):
    """Non-randomised APS: the mass ranked strictly above the label (ties by class index) plus its own."""
    own = probabilities[label]
    return sum(p for k, p in enumerate(probabilities) if p > own or (p == own and k < label)) + own


def slow_loss(logits1, labels1, logits2, labels2, alpha):
    """ConfTS's loss in plain Python floats."""
    def scores(logits, labels):
        out = []
        for row, label in zip(logits, labels):
            exps = [math.exp(v) for v in row]
            out.append(aps_by_hand([e / sum(exps) for e in exps], label))
        return out
    calibration = sorted(scores(logits1, labels1))
    tau = calibration[min(math.ceil((len(calibration) + 1) * (1 - alpha)), len(calibration)) - 1]
    return sum((tau - s) ** 2 for s in scores(logits2, labels2)) / len(logits2)


def test_loss_and_its_logit_gradient_against_a_slow_reference():
    """Without ``attach`` (a bare step) the loss reaches the logits: its value and its gradient
    (central differences of the slow reference) on four classes."""
    generator = torch.Generator().manual_seed(3)
    l1, l2 = (torch.randn(9, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    y1, y2 = (torch.randint(0, 4, (9,), generator=generator) for _ in range(2))
    l1.requires_grad_(), l2.requires_grad_()
    out = confts(alpha=0.2)(l1, y1, l2, y2)
    out.loss.backward()
    plain = [l1.detach().tolist(), y1.tolist(), l2.detach().tolist(), y2.tolist()]
    assert out.loss.item() == pytest.approx(slow_loss(*plain, 0.2), rel=1e-12)
    step = 1e-6
    for which, grad in ((0, l1.grad), (2, l2.grad)):
        for i in range(9):
            for k in range(4):
                up, down = [list(map(list, plain[which])) for _ in range(2)]
                up[i][k] += step
                down[i][k] -= step
                numeric = (slow_loss(*[up if j == which else v for j, v in enumerate(plain)], 0.2)
                           - slow_loss(*[down if j == which else v for j, v in enumerate(plain)], 0.2)) / (2 * step)
                assert grad[i, k].item() == pytest.approx(numeric, abs=1e-7), (which, i, k)


def test_attach_freezes_the_network_keeps_it_in_evaluation_mode_and_saves_t_folded():
    torch.manual_seed(0)
    model = build_model("mlp_bn", 10, input_shape=(1, 8, 8))
    plain_state = {name: value.clone() for name, value in model.state_dict().items()}
    objective = confts()
    objective.attach(model, (1, 8, 8))
    assert isinstance(model.net[7], TemperatureScaledLinear)
    assert [name for name, p in model.named_parameters() if p.requires_grad] == ["net.7.log_temperature"]
    with torch.no_grad():
        objective.layer.log_temperature.fill_(math.log(2.0))
    x = torch.randn(6, 1, 8, 8)
    model.train()  # what the loop does before its steps
    scaled = model(x)
    assert not model.training  # the network runs in evaluation mode: BatchNorm's statistics stay
    saved = model.state_dict()
    assert list(saved) == list(plain_state)  # the plain model's names: no temperature among them
    for name, value in saved.items():
        expected = plain_state[name] / 2 if name in ("net.7.weight", "net.7.bias") else plain_state[name]
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=0), name
    fresh = build_model("mlp_bn", 10, input_shape=(1, 8, 8))
    fresh.load_state_dict(saved)
    torch.testing.assert_close(fresh.eval()(x), scaled, rtol=1e-5, atol=1e-6)  # a predictor reads T from the weights
    with torch.no_grad():
        original = build_model("mlp_bn", 10, input_shape=(1, 8, 8))
        original.load_state_dict(plain_state)
        torch.testing.assert_close(scaled, original.eval()(x) / 2, rtol=1e-5, atol=1e-6)


def test_a_model_whose_logits_are_not_a_linear_layer_s_output_is_refused():
    with pytest.raises(ValueError, match="not the output of an nn.Linear"):
        confts().attach(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), (4,))
    assert classifier_layer(nn.Sequential(nn.Flatten(), nn.Linear(4, 3)), (2, 2)) == "1"


class Interrupted(Exception):
    pass


class InterruptingEnv(LocalEnv):
    """Saves the checkpoint of ``stop_after`` epochs, then dies."""

    def __init__(self, stop_after, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_after = stop_after

    def report(self, row, checkpoint, epochs=None):
        super().report(row, checkpoint, epochs)
        if row["epoch"] == self.stop_after:
            raise Interrupted


def test_a_run_changes_only_the_temperature_and_resumes_exactly(tmp_path):
    """From given weights (a BatchNorm MLP), two epochs of ConfTS: every tensor of the model but
    the classifier layer is unchanged -- BatchNorm's running statistics too -- and the classifier's
    weight and bias are the given ones divided by the T the objective holds.  A run stopped after
    epoch 1 and resumed ends with the same model."""
    torch.manual_seed(1)
    given = build_model("mlp_bn", 10, input_shape=(1, 8, 8)).state_dict()
    torch.save(given, tmp_path / "given.pt")
    config = TrainConfig(dataset="digits", model="mlp_bn", method="confts", init=f"weights:{tmp_path / 'given.pt'}", epochs=2, lr=0.5,
                         batch_size=64, eval_splits=2, val_splits=2)
    quiet = dict(log=lambda line: None)
    result = train(config, LocalEnv(torch.device("cpu"), tmp_path / "whole.pt", **quiet))
    temperature = torch.load(tmp_path / "whole.pt", weights_only=True)["objective"]["log_temperature"].exp().item()
    assert abs(temperature - 1) > 1e-3  # T moved
    for name, value in result.model_state.items():
        if name in ("net.7.weight", "net.7.bias"):
            torch.testing.assert_close(value, given[name] / temperature, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(value, given[name]), name
    with pytest.raises(Interrupted):
        train(config, InterruptingEnv(1, torch.device("cpu"), tmp_path / "resumed.pt", **quiet))
    resumed = train(config, LocalEnv(torch.device("cpu"), tmp_path / "resumed.pt", **quiet))
    for name, value in result.model_state.items():
        assert torch.equal(resumed.model_state[name], value), name
    assert [row["upper_loss"] for row in resumed.epochs] == [row["upper_loss"] for row in result.epochs]


def test_the_objective_state_is_empty_until_attached_and_refuses_nothing_it_cannot_hold():
    objective = confts()
    assert objective.state_dict() == {}
    objective.load_state_dict({})  # a checkpoint of a bare objective
    assert type(objective) is ConfTS and objective.batch_split == "batch" and not objective.uses_quantile
