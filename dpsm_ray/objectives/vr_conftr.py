"""VR-ConfTr (Noorani, Romero, Dal Fabbro, Hassani, Pappas, "Conformal Risk Minimization with
Variance Reduction", arXiv 2411.01696): ConfTr whose batch quantile keeps its value but takes its
gradient from a variance-reduced estimate.

ConfTr differentiates the loss through tau(theta), the conformal quantile of a calibration batch
B1.  The gradient of the population quantile is E[grad S_theta(X, Y) | S_theta(X, Y) = tau]; the
batch quantile's own gradient is that of the one score it selects, which is what makes ConfTr's
gradient noisy (the paper's analysis).  VR-ConfTr decouples the two: tau is the exact conformal
quantile of B1's scores, and its gradient is the mean gradient of the m calibration scores nearest
to it (the paper's "m-ranking" estimator, a plug-in for the conditional expectation):

    grad tau ~ (1/m) sum_{i in N_m} grad S(x_i, y_i),   N_m = the m of B1 with the smallest |S_i - tau|,

written here as tau + mean_{N_m}(S) - mean_{N_m}(S).detach(): the value of tau, that gradient.  The
rest is this project's ConfTr (``dpsm_ray.objectives.conftr``): HPS scores 1 - p_y, the loss
CE + lambda * soft set size of B2 at tau, B1 and B2 the two random halves of each batch (the
authors' code halves each batch).  m defaults to 4, the authors' Fashion-MNIST setting
(nooranisima/conformal-risk-minimization-w-variance-reduction-code, config/config.py
``num_sort``; algorithms/vr_sort.py selects the m nearest by sorting |S_i - tau|).  The paper's
numbered equations were not readable through this project's tools; the estimator is as the
authors' code computes it.  docs/baselines.md lists where this departs from that code.
"""

from __future__ import annotations

import torch

from dpsm_ray.conformal import hard_batch_quantile, label_scores, pinball_loss, soft_set_size
from dpsm_ray.objectives.base import ObjectiveOutput, hps_scores, step_cross_entropy
from dpsm_ray.objectives.conftr import ConfTr


def variance_reduced_quantile(calibration_scores: torch.Tensor, alpha: float, neighbours: int) -> torch.Tensor:
    """The conformal quantile of ``calibration_scores`` (capped at rank n) carrying the mean
    gradient of the ``neighbours`` scores nearest to it instead of its own score's."""
    tau = hard_batch_quantile(calibration_scores, alpha).detach()
    count = min(neighbours, calibration_scores.shape[-1])
    nearest = (calibration_scores.detach() - tau).abs().topk(count, largest=False).indices
    mean = calibration_scores[nearest].mean()
    return tau + (mean - mean.detach())


class VRConfTr(ConfTr):
    graph_safe = False  # not yet compared captured and eager on a GPU (tests/train/test_step.py)

    def __init__(self, *, sigmoid_temperature: float, neighbours: int = 4, **kwargs) -> None:
        super().__init__(sigmoid_temperature=sigmoid_temperature, sort_temperature=0.0, split="batch", **kwargs)
        if neighbours < 1:
            raise ValueError(f"neighbours (VR-ConfTr's m) must be >= 1; got {neighbours}")
        self.neighbours = neighbours

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = step_cross_entropy("full", logits1, labels1, logits2, labels2)
        calibration_scores = self.collective.gather(label_scores(hps_scores(logits1), labels1))
        tau = variance_reduced_quantile(calibration_scores, self.alpha, self.neighbours)
        size = soft_set_size(hps_scores(logits2), tau, self.sigmoid_temperature)
        return self.output(ce, size, pinball_loss(tau, calibration_scores, self.alpha), tau)
