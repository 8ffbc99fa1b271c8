"""ConfTS (Xi et al., "Does confidence calibration improve conformal prediction?", TMLR 2025,
arXiv 2402.04344): conformal temperature scaling.  The network is frozen; one temperature T
divides its logits, and T is trained so that the score of each example's true label lands on the
conformal threshold:

    min_T  (1/|B2|) sum_{i in B2} (tau(T) - S_T(x_i, y_i))^2,
    tau(T) = the conformal (1 - alpha) quantile of {S_T(x_j, y_j) : j in B1},

S_T the non-randomised APS score of the softmax of z / T (the probability mass ranked above y plus
p_y).  The paper states the loss in words ("the gap between the threshold and the non-conformity
score of the ground truth", abstract; its equation was not readable through this project's tools);
the squared gap, the APS score, the exact batch quantile, log T as the trained parameter and the
halves of each batch are the authors' code (ml-stat-Sustech/Does-Confidence-Calibration-Improve-
Conformal-Prediction, src/scalings.py, ``ConformalTemperatureScaling.criterion``).  tau carries a
gradient to the score it selects, as there.

Where T lives: in the classifier layer.  ``attach`` freezes every weight, keeps the network in
evaluation mode (BatchNorm's statistics and dropout as they were: the official code fits T on
fixed logits), and replaces the ``nn.Linear`` whose output is the logits by
``TemperatureScaledLinear``, which divides them by T = exp(log_temperature) -- the only parameter
that trains.  Its state dict is a plain ``nn.Linear``'s with 1/T folded into its weight and bias, so
evaluation, checkpoints, exported predictors and the base-model cache see the temperature-scaled
model as the architecture they know.  docs/baselines.md lists where this departs from the
authors' code and TorchCP's ``ConfTSLoss``.
"""

from __future__ import annotations

import torch
from torch import nn

from dpsm_ray.conformal import aps_matrix, hard_batch_quantile, label_scores, pinball_loss
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, cross_entropy


def _aps_label_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The non-randomised APS score of each true label: the mass ranked strictly above it plus its
    own probability (APS with U = 1)."""
    return label_scores(aps_matrix(logits.softmax(dim=1), None), labels)


class TemperatureScaledLinear(nn.Linear):
    """A frozen linear layer whose output is divided by T = exp(``log_temperature``).

    Saved and loaded as the ``nn.Linear`` it replaced: ``state_dict`` holds weight / T and bias / T
    under the layer's own names, and loading one sets weight and bias and T = 1 (``ConfTS``'s own
    state restores the unscaled weights and T exactly when a run resumes)."""

    def __init__(self, linear: nn.Linear) -> None:
        weight = linear.weight
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
            if self.bias is not None:
                self.bias.copy_(linear.bias)
        self.requires_grad_(False)
        self.log_temperature = nn.Parameter(torch.zeros((), device=weight.device, dtype=weight.dtype))  # T_0 = 1: the model as given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.exp(-self.log_temperature)

    def temperature(self) -> float:
        return float(self.log_temperature.detach().exp())

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        scale = torch.exp(-self.log_temperature.detach())
        destination[prefix + "weight"] = self.weight.detach() * scale
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias.detach() * scale

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for name, parameter in (("weight", self.weight), ("bias", self.bias)):
            if parameter is None:
                continue
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
                continue
            with torch.no_grad():
                parameter.copy_(state_dict[prefix + name])
        with torch.no_grad():
            self.log_temperature.zero_()


def classifier_layer(model: nn.Module, input_shape: tuple[int, ...]) -> str:
    """The name of the ``nn.Linear`` whose output the model returns as its logits: found by one
    forward of two zero inputs in evaluation mode (a model that transforms its last layer's
    output, or has no linear layer there, is refused: ConfTS's temperature lives in that layer)."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(lambda _module, _inputs, output, name=name: outputs.__setitem__(name, output))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name
    ]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            parameter = next(model.parameters())
            logits = model(torch.zeros(2, *input_shape, device=parameter.device, dtype=parameter.dtype))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    found = [name for name, output in outputs.items() if output is logits]
    if not found:
        raise ValueError(
            f"ConfTS keeps its temperature in the classifier layer, but {type(model).__name__}'s logits are not the output of an nn.Linear"
            " submodule: use a model that ends in a linear layer"
        )
    return found[0]


def _keep_evaluation_mode(module: nn.Module, inputs) -> None:
    """A forward pre-hook: the frozen network runs in evaluation mode whatever mode the loop set."""
    module.train(False)


class ConfTS(Objective):
    """ConfTS's loss (module docstring); ``quantile`` in the statistics is tau on the APS scale,
    ``conformal`` the squared gap (the whole loss), ``ce`` the cross-entropy at the current T."""

    batch_split = "batch"  # each batch of the training split halved at random, as the authors' code halves its set
    graph_safe = False  # not yet compared captured and eager on a GPU (tests/train/test_step.py)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layer: TemperatureScaledLinear | None = None

    def attach(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        """Freeze ``model``, keep it in evaluation mode and put T in its classifier layer (the
        module docstring); without this -- a bare step in a test -- the loss reaches every weight."""
        name = classifier_layer(model, input_shape)
        parent_name, _, child = name.rpartition(".")
        model.requires_grad_(False)
        self.layer = TemperatureScaledLinear(getattr(model.get_submodule(parent_name), child))
        setattr(model.get_submodule(parent_name), child, self.layer)
        model.register_forward_pre_hook(_keep_evaluation_mode)

    def start_line(self, d1_scores: torch.Tensor) -> str | None:
        if self.layer is None:
            return None
        return f"trains the temperature T of the frozen network's classifier layer only, T_0 = {self.layer.temperature():g}"

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        calibration_scores = self.collective.gather(_aps_label_scores(logits1, labels1))
        tau = hard_batch_quantile(calibration_scores, self.alpha)
        gap = ((tau - _aps_label_scores(logits2, labels2)) ** 2).mean()
        ce = cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        stats = {"ce": ce.detach(), "conformal": gap.detach(), "upper": gap.detach(),
                 "pinball": pinball_loss(tau, calibration_scores, self.alpha).detach(), "quantile": tau.detach()}
        return ObjectiveOutput(gap, stats)

    def state_dict(self) -> dict:
        """The unscaled classifier weights and log T: a resumed run continues exactly (the model's
        own state dict holds them folded, T = 1)."""
        if self.layer is None:
            return {}
        state = {"log_temperature": self.layer.log_temperature, "weight": self.layer.weight, "bias": self.layer.bias}
        return {name: None if value is None else value.detach().cpu().clone() for name, value in state.items()}

    def load_state_dict(self, state: dict) -> None:
        if self.layer is None or not state:
            return
        with torch.no_grad():
            for name in ("log_temperature", "weight", "bias"):
                if state[name] is not None:
                    getattr(self.layer, name).copy_(state[name])
