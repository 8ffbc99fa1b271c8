"""RWCE (Jia, Shi, Liu, Xu, Yan, "Cost-Sensitive Conformal Training with Provably Controllable
Learning Bounds", AAAI 2026, arXiv 2511.17861): rank-weighted cross-entropy.

The paper bounds the expected size of the conformal prediction sets by the expected rank of the
true label, and trains on cross-entropy weighted by that rank -- no sigmoid surrogate of the set
indicator, no batch quantile:

    L = (1/n) sum_i r_i^gamma * CE(z_i, y_i),   r_i = 1 + #{k : z_ik > z_iy_i},

over the step's whole batch (B1 and B2).  r_i is the 1-based rank of the true label among the
logits (the softmax's order; a label tied with y_i does not count against it) and carries no
gradient: it is a weight.  gamma (``rank_exponent``) is 1 by default.  The paper's own equation was
not readable through this project's tools (its abstract and summaries: "a rank weighting strategy
that assigns the weight using the rank of true label on each data sample"); the form above and
gamma are from a public repository named RWCE (JoSaitama/RWCE, train/train_cifar.py
``_run_batch_IWCE``, the loss under the paper's earlier name, importance-weighted CE; its
``--IWCE_rank_exponent`` defaults to 1), not confirmed as the authors' official code.
docs/baselines.md lists where this departs from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpsm_ray.objectives.base import Objective, ObjectiveOutput


def true_label_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1 + the number of labels whose logit is strictly above the true label's, ``[n]``."""
    own = logits.gather(1, labels[:, None])
    return (logits > own).sum(dim=1) + 1


class RankWeightedCE(Objective):
    """RWCE (module docstring).  Statistics: ``ce`` the plain cross-entropy of the batch,
    ``conformal`` the mean rank of the true label (the paper's bound on the expected set size),
    ``upper`` the loss."""

    graph_safe = False  # not yet compared captured and eager on a GPU (tests/train/test_step.py)

    def __init__(self, *, rank_exponent: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if rank_exponent < 0:
            raise ValueError(f"rank_exponent (RWCE's gamma) must be >= 0; got {rank_exponent}")
        self.rank_exponent = rank_exponent

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        logits, labels = torch.cat([logits1, logits2]), torch.cat([labels1, labels2])
        each = F.cross_entropy(logits, labels, reduction="none")
        rank = true_label_rank(logits.detach(), labels).to(each.dtype)
        loss = (rank**self.rank_exponent * each).mean()
        nan = torch.full((), torch.nan, device=loss.device)
        stats = {"ce": each.mean().detach(), "conformal": rank.mean(), "upper": loss.detach(), "pinball": nan, "quantile": nan}
        return ObjectiveOutput(loss, stats)
