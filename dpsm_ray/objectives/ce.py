"""CE: cross-entropy on both halves of the step's batch; no conformal term."""

from __future__ import annotations

import torch

from dpsm_ray.objectives.base import Objective, ObjectiveOutput, cross_entropy


class CrossEntropy(Objective):
    graph_safe = True

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        return self.output(ce, torch.zeros((), device=ce.device))
