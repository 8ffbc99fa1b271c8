"""What every training objective shares: the call shape, the HPS training score, the output."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpsm_ray.collective import LocalCollective
from dpsm_ray.conformal import hps_matrix


@dataclass
class ObjectiveOutput:
    """``loss`` carries the gradient; ``stats`` are detached scalars for logging:
    ``ce``, ``conformal`` (the unweighted L_c term), ``upper`` (ce + lambda * conformal),
    ``pinball`` (lower-level loss at ``quantile``) and ``quantile`` (DPSM's q or ConfTr's batch
    tau; NaN where the method has none).  ``parts``: the loss's two terms with their graphs, ``ce``
    and ``size`` (lambda x L_c), where it is their sum: what the epoch diagnostics take the
    gradient norm of (``dpsm_ray.train.loop.term_gradient_norms``); None where it is not."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]
    parts: dict[str, torch.Tensor] | None = None


# each epoch's mean of a stat -> its column of epochs.parquet
STAT_COLUMNS = {"upper": "upper_loss", "ce": "ce_loss", "conformal": "conformal_loss", "pinball": "lower_loss"}


def hps_scores(logits: torch.Tensor) -> torch.Tensor:
    """Training score of every label: HPS on softmax probabilities, ``[n, K]``."""
    return hps_matrix(logits.softmax(dim=1))


class Objective:
    """L_cls(f) + lambda * L_c(f), called on the logits of a batch B1 from D1 and B2 from D2.

    ``conformal_weight`` is the paper's lambda.  Subclasses with state (DPSM's q) override
    ``initialize``, ``state_dict`` and ``load_state_dict``.
    """

    # where B1 and B2 come from: "halves" -- the fixed halves D1 and D2 of the training split
    # (Algorithm 1) -- or "batch" -- each batch of the whole training split cut in two at random
    batch_split = "halves"
    # What the training loop asks of a method instead of its class: whether it trains with a
    # quantile of the conformity scores (its epochs log q against Q_n), and its step size gamma
    # for a learned one (epochs.parquet's quantile_lr; NaN where there is none).
    uses_quantile = False
    quantile_lr = math.nan
    # Whether its call may be captured in a CUDA graph, which ``--step auto`` does on CUDA: no host
    # synchronisation (``.item()``, a Python branch on a tensor value), state updated in place.
    # True only for objectives that tests/train/test_step.py has compared captured and eager on a
    # GPU; ``--step graph`` captures any objective it is asked to.
    graph_safe = False

    def __init__(self, *, alpha: float, conformal_weight: float, collective=None) -> None:
        self.alpha = alpha
        self.conformal_weight = conformal_weight
        self.collective = collective or LocalCollective()

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        raise NotImplementedError

    def attach(self, model: torch.nn.Module, input_shape: tuple[int, ...]) -> None:
        """Called once with the run's model -- built, its starting weights loaded, still on the CPU --
        before the optimizer is made (``input_shape``: one example's).  A method that trains
        something other than every weight changes the model here: ConfTS freezes the network and
        gives its classifier layer a temperature.  The optimizer steps the parameters that then
        require a gradient."""

    def initialize(self, train_label_scores: torch.Tensor) -> None:
        """Called once before training with the starting model's D1 label scores (all workers)."""

    def prepare(self, device: torch.device) -> None:
        """Put any state on ``device`` before the first step (a captured step needs it there)."""

    def learned_quantile(self) -> float | None:
        """The quantile the method learns as state (DPSM's q), or None: an epoch then reports the
        mean of the steps' ``quantile`` stats."""
        return None

    def training_quantiles(self, d1_scores: torch.Tensor, train_scores: torch.Tensor, batch_size: int, generator: torch.Generator,
                           batches: int) -> torch.Tensor | None:
        """The quantile(s) the method trains with at the current model, on the HPS scores of D1
        and of the whole training split (epochs.parquet's q diagnostics); None where it has none
        on that scale.  ``generator`` draws any random batches, at most ``batches`` of them."""
        return None

    def start_line(self, d1_scores: torch.Tensor) -> str | None:
        """What the log says once the state is initialised (DPSM: q_0 against Q_n); None: nothing."""
        return None

    def state_tensors(self) -> list[torch.Tensor]:
        """The state a step changes in place on the device (DPSM's q, CUT's step counter): what a
        captured CUDA graph must find at the same addresses and restore after its warm-up."""
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Stateless objectives have nothing to restore."""

    def output(self, ce, conformal, pinball=None, quantile=None) -> ObjectiveOutput:
        nan = torch.full((), torch.nan, device=ce.device)
        size = self.conformal_weight * conformal
        loss = ce + size
        stats = {
            "ce": ce.detach(),
            "conformal": conformal.detach(),
            "upper": loss.detach(),
            "pinball": nan if pinball is None else pinball.detach(),
            "quantile": nan if quantile is None else quantile.detach(),
        }
        return ObjectiveOutput(loss, stats, {"ce": ce, "size": size})


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def step_cross_entropy(ce_batch: str, logits1, labels1, logits2, labels2) -> torch.Tensor:
    """CE on the step's whole batch (B1 and B2: the official code) or on B1 only (the tex's
    Algorithm 1, where D2 then never gets a CE gradient)."""
    if ce_batch == "half":
        return cross_entropy(logits1, labels1)
    return cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value
