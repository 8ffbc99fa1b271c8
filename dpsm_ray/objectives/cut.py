"""CUT (Einbinder et al. 2022): penalise the Kolmogorov-Smirnov distance between the batch's
score distribution and Unif(0, 1).

CE on the whole batch (``ce_batch="full"``, the official code) or on B1 (``"half"``), plus lambda
times sup_t |F_hat(t) - t| over B2's label scores (global B2 with several workers).  With the sorted
scores s_(1) <= ... <= s_(n) the supremum is max_i max(i/n - s_(i), s_(i) - (i-1)/n); the sort is
NeuralSort's differentiable relaxation (``sort_temperature``; 0 uses the exact sort, which is differentiable in the values too).

``score``: ``hps`` (1 - p_y, this project's default), or ``aps``, the randomised APS conformity
score Einbinder et al. use -- exactly Unif(0, 1) for the true conditional distribution, which is
what makes the uniform the right target.  Its U is fresh for every step and batch position, a
pure function of (run seed, step, position in the global B2): the same on any worker count, and
computed on the device from a step counter that is part of the objective's state (so a resumed
run, and a step captured in a CUDA graph, draw the same U).
"""

from __future__ import annotations

import torch

from dpsm_ray.facts import CE_BATCHES, CUT_SCORES
from dpsm_ray.conformal import aps_matrix, label_scores, soft_sort
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, check_choice, hps_scores, step_cross_entropy
from dpsm_ray.seeding import counter_uniforms, derive_seed


def ks_to_uniform(values: torch.Tensor, sort_temperature: float) -> torch.Tensor:
    """sup_t |F_hat(t) - t| of the empirical distribution of ``values`` against Unif(0, 1)."""
    ordered = values.sort().values if sort_temperature == 0 else soft_sort(values, sort_temperature)
    n = values.shape[-1]
    upper = torch.arange(1, n + 1, device=values.device, dtype=values.dtype) / n
    return torch.maximum(upper - ordered, ordered - (upper - 1 / n)).max()


class CUT(Objective):
    graph_safe = True

    def __init__(self, *, sort_temperature: float, score: str = "hps", seed: int = 0, ce_batch: str = "full", **kwargs) -> None:
        super().__init__(**kwargs)
        check_choice("score", score, CUT_SCORES)
        self.ce_batch = check_choice("ce_batch", ce_batch, CE_BATCHES)
        self.sort_temperature = sort_temperature
        self.score = score
        self.uniform_seed = derive_seed(seed, "cut_uniforms")
        self.steps = torch.zeros((), dtype=torch.int64)  # steps taken: APS's U of the next one

    def prepare(self, device: torch.device) -> None:
        if self.steps.device != device:
            self.steps = self.steps.to(device)

    def uniforms(self, local_size: int, device: torch.device) -> torch.Tensor:
        """U for this worker's part of the global B2 at the current step."""
        global_size = local_size * self.collective.world_size
        position = self.collective.rank * local_size + torch.arange(local_size, device=device)
        return counter_uniforms(self.uniform_seed, self.steps * global_size + position)

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        ce = step_cross_entropy(self.ce_batch, logits1, labels1, logits2, labels2)
        if self.score == "hps":
            local_scores = label_scores(hps_scores(logits2), labels2)
        else:
            self.prepare(logits2.device)
            u = self.uniforms(logits2.shape[0], logits2.device)
            local_scores = label_scores(aps_matrix(logits2.softmax(dim=1), u), labels2)
            self.steps.add_(1)
        scores = self.collective.gather(local_scores)
        return self.output(ce, ks_to_uniform(scores, self.sort_temperature))

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.steps] if self.score == "aps" else []

    def state_dict(self) -> dict:
        return {"steps": self.steps.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"].clone()
