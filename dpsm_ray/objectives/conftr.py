"""ConfTr: the soft set size at a *batch* quantile -- the stochastic approximation that DPSM
replaces -- in the two forms the literature has.

``ConfTr`` is the DPSM paper's description (its section 5 and official code): lambda times the soft
set size of B2 at tau, the conformal (1 - alpha) quantile of B1's HPS label scores (1 - p_y), plus
CE.  tau is differentiable (smooth sort with ``sort_temperature``, or the exact order statistic
when it is 0) and, with several workers, taken over the global B1.  Where B1 and B2 come from is
``split``: ``halves`` -- B1 from D1 calibrates, B2 from D2 predicts, CE on B1, the fixed halves of
Algorithm 1 (so CE never sees D2); ``batch`` -- B1 and B2 are the two random halves of one batch
of the whole training set (the loop draws them so), and CE is on the whole batch, as in Stutz et
al. and the official DPSM code.

``ConfTrPublished`` is ConfTr as Stutz et al. (ICLR 2022) published it, from their code
(google-deepmind/conformal_training, the Fashion-MNIST configuration): scores on log-probabilities,
tau the smooth conformal quantile of B1's scores, and the logarithm of the size loss,

    loss = log(lambda * Omega + 1e-8) + ce_weight * CE,
    Omega = mean over B2 of max(sum_k sigmoid((tau - s_k) / T) - kappa, 0),  s_k = -log p_k,

with B1 and B2 the two random halves of each batch of the whole training set.  Their THR
configuration has no classification loss (``ce_weight`` 0) and kappa 0, T 0.1, lambda 0.01 (inside
the logarithm lambda only shifts the loss, apart from the 1e-8).  Their smooth sort is a
variational sorting network with dispersion 0.1 and their quantile the lower (1 + 1/n) alpha
quantile of log p_y; here the same quantile of s_y = -log p_y comes from this project's NeuralSort
(``sort_temperature``) at the conformal rank -- the same target, another relaxation.
"""

from __future__ import annotations

import torch

from dpsm_ray.facts import CONFTR_SPLITS
from dpsm_ray.conformal import hard_batch_quantile, label_scores, pinball_loss, smooth_quantile, soft_set_size
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, check_choice, cross_entropy, hps_scores, step_cross_entropy

# Stutz et al.'s log(lambda * Omega + 1e-8): the constant keeps the logarithm finite at Omega = 0
_LOG_SIZE_EPSILON = 1e-8


def batch_quantile(calibration_scores: torch.Tensor, alpha: float, sort_temperature: float) -> torch.Tensor:
    """The conformal (1 - alpha) quantile of a batch's non-conformity scores: smooth (NeuralSort at
    ``sort_temperature``) or, at temperature 0, the exact order statistic."""
    if sort_temperature == 0:
        return hard_batch_quantile(calibration_scores, alpha)
    return smooth_quantile(calibration_scores, alpha, sort_temperature)


class ConfTr(Objective):
    uses_quantile = True
    graph_safe = True

    def __init__(self, *, sigmoid_temperature: float, sort_temperature: float, split: str = "halves", **kwargs) -> None:
        super().__init__(**kwargs)
        self.split = self.batch_split = check_choice("split", split, CONFTR_SPLITS)
        self.sigmoid_temperature = sigmoid_temperature
        self.sort_temperature = sort_temperature

    def batch_quantile(self, calibration_scores):
        return batch_quantile(calibration_scores, self.alpha, self.sort_temperature)

    def training_quantiles(self, d1_scores, train_scores, batch_size, generator, batches):
        """Batch quantiles of the calibration pool (D1 for the halves split, else the whole
        training split) cut into random disjoint batches of the run's calibration size: all of
        them, or the first ``batches`` of the random order (an unbiased sample of them: each
        diagnostic is a mean over the quantiles, and its cost grows with their number)."""
        pool = d1_scores if self.split == "halves" else train_scores
        half = batch_size // 2
        order = torch.randperm(pool.numel(), generator=generator).to(pool.device)
        usable = min(pool.numel() // half, batches) * half
        return self.batch_quantile(pool[order[:usable]].reshape(-1, half)).detach()

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = step_cross_entropy("half" if self.split == "halves" else "full", logits1, labels1, logits2, labels2)
        calibration_scores = self.collective.gather(label_scores(hps_scores(logits1), labels1))
        tau = self.batch_quantile(calibration_scores)
        size = soft_set_size(hps_scores(logits2), tau, self.sigmoid_temperature)
        return self.output(ce, size, pinball_loss(tau, calibration_scores, self.alpha), tau)


class ConfTrPublished(Objective):
    """ConfTr as published (module docstring).  ``quantile`` in the statistics is tau on the
    -log p scale."""

    batch_split = "batch"
    graph_safe = True

    def __init__(
        self, *, sigmoid_temperature: float, sort_temperature: float, size_target: float = 0.0, ce_weight: float = 0.0, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.sigmoid_temperature, self.sort_temperature = sigmoid_temperature, sort_temperature
        self.size_target, self.ce_weight = size_target, ce_weight

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        calibration_scores = self.collective.gather(label_scores(-logits1.log_softmax(dim=1), labels1))
        tau = batch_quantile(calibration_scores, self.alpha, self.sort_temperature)
        sizes = torch.sigmoid((tau - -logits2.log_softmax(dim=1)) / self.sigmoid_temperature).sum(dim=1)
        omega = (sizes - self.size_target).clamp(min=0).mean()
        size_loss = torch.log(self.conformal_weight * omega + _LOG_SIZE_EPSILON)
        ce = cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        loss = size_loss + self.ce_weight * ce if self.ce_weight else size_loss
        stats = {"ce": ce.detach(), "conformal": omega.detach(), "upper": loss.detach(),
                 "pinball": pinball_loss(tau, calibration_scores, self.alpha).detach(), "quantile": tau.detach()}
        return ObjectiveOutput(loss, stats)
