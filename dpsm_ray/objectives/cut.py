"""CUT (Einbinder et al. 2022): penalise the Kolmogorov-Smirnov distance between the batch's
score distribution and Unif(0, 1).

CE on B1, plus lambda times sup_t |F_hat(t) - t| over B2's label scores (global B2 with several
workers).  With the sorted scores s_(1) <= ... <= s_(n) the supremum is
max_i max(i/n - s_(i), s_(i) - (i-1)/n); the sort is NeuralSort's differentiable relaxation
(``sort_temperature``; 0 uses the exact sort, which is differentiable in the values too).
"""

from __future__ import annotations

import torch

from dpsm_ray.conformal import label_scores, soft_sort
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, cross_entropy, hps_scores


def ks_to_uniform(values: torch.Tensor, sort_temperature: float) -> torch.Tensor:
    """sup_t |F_hat(t) - t| of the empirical distribution of ``values`` against Unif(0, 1)."""
    ordered = values.sort().values if sort_temperature == 0 else soft_sort(values, sort_temperature)
    n = values.shape[-1]
    upper = torch.arange(1, n + 1, device=values.device, dtype=values.dtype) / n
    return torch.maximum(upper - ordered, ordered - (upper - 1 / n)).max()


class CUT(Objective):
    name = "cut"

    def __init__(self, *, sort_temperature: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sort_temperature = sort_temperature

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = cross_entropy(logits1, labels1)
        scores = self.collective.gather(label_scores(hps_scores(logits2), labels2))
        return self._output(ce, ks_to_uniform(scores, self.sort_temperature))
