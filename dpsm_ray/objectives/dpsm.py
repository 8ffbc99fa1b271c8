"""DPSM (Shi et al., ICML 2025, Algorithm 1): conformal training as a bilevel problem.

    min_{f, q}  L_cls(f) + lambda * (1/n) sum_i sum_y sigmoid((q - S_f(x_i, y)) / T)
    s.t.        q in argmin_q' (1/n) sum_i rho_alpha(q', S_f(x_i, y_i))

Each step, with B1 from D1 and B2 from D2:
  * the gradient of CE and of the soft set size on B2 at the current q go to f -- CE on the whole
    batch (``ce_batch="full"``, the official code) or on B1 (``"half"``, the tex);
  * q moves by the pinball gradient on B1's detached scores, averaged over all workers:
        q <- q - gamma * (mean(1[s < q]) - (1 - alpha)).
q is one scalar, not a function of any batch: that decoupling is what gives the O(1/sqrt(n))
learning bound instead of the batch quantile's Omega(1/s).  It is plain state outside autograd,
so no graph grows across steps, and it is updated in place on the model's device, so a step
captured in a CUDA graph (``dpsm_ray.train.step``) carries the update inside the graph.
"""

from __future__ import annotations

import torch

from dpsm_ray.facts import CE_BATCHES, Q_INITS, SPLITS
from dpsm_ray.conformal import empirical_quantile, label_scores, pinball_grad, pinball_loss, soft_set_size
from dpsm_ray.objectives.base import Objective, ObjectiveOutput, check_choice, hps_scores, step_cross_entropy
from dpsm_ray.seeding import generator


class DPSM(Objective):
    uses_quantile = True
    graph_safe = True

    def __init__(self, *, sigmoid_temperature: float, quantile_lr: float, q_init: str = "dataset", seed: int = 0, ce_batch: str = "full",
                 split: str = "halves", **kwargs) -> None:
        super().__init__(**kwargs)
        check_choice("q_init", q_init, Q_INITS)
        self.ce_batch = check_choice("ce_batch", ce_batch, CE_BATCHES)
        # "batch": B1 and B2 are the two random halves of each batch of the whole training split,
        # as the official code splits each batch in place (63 and 65 of 128 there)
        self.batch_split = check_choice("split", split, SPLITS)
        self.sigmoid_temperature = sigmoid_temperature
        self.quantile_lr = quantile_lr  # gamma
        self.q_init, self.seed = q_init, seed
        self.q: torch.Tensor | None = None

    def initialize(self, train_label_scores: torch.Tensor) -> None:
        """q_0: Q_n, the (1 - alpha) quantile of the starting model's D1 scores (``dataset``, this
        project's default); 0 (``zero``); or Unif(0, 1), the range of HPS scores, drawn from the
        run seed (``random``: Algorithm 1, line 2).  The same value on every worker."""
        scores = train_label_scores.detach()
        if self.q_init == "dataset":
            self.q = empirical_quantile(scores, 1 - self.alpha).clone()
        elif self.q_init == "zero":
            self.q = torch.zeros((), dtype=scores.dtype, device=scores.device)
        else:
            self.q = torch.rand((), generator=generator(self.seed, "q_init"), dtype=torch.float64).to(scores.device, scores.dtype)

    def learned_quantile(self) -> float | None:
        return float(self.q)

    def training_quantiles(self, d1_scores, train_scores, batch_size, generator, batches):
        return self.q.detach().double().reshape(1)

    def start_line(self, d1_scores: torch.Tensor) -> str | None:
        return (f"q_0 {float(self.q):.4f} ({self.q_init})  Q_n {float(empirical_quantile(d1_scores, 1 - self.alpha)):.4f}"
                f"  quantile_lr {self.quantile_lr:.4g} per step")

    def prepare(self, device: torch.device) -> None:
        if self.q is not None and self.q.device != device:
            self.q = self.q.to(device)

    def __call__(self, logits1, labels1, logits2, labels2) -> ObjectiveOutput:
        if self.q is None:
            raise RuntimeError("DPSM.initialize(D1 scores) must run before the first step")
        self.prepare(logits1.device)
        q = self.q.clone()  # this step's q; self.q itself moves below
        ce = step_cross_entropy(self.ce_batch, logits1, labels1, logits2, labels2)
        size = soft_set_size(hps_scores(logits2), q, self.sigmoid_temperature)
        lower_scores = label_scores(hps_scores(logits1.detach()), labels1)
        grad_q = self.collective.mean(pinball_grad(q, lower_scores, self.alpha))
        pinball = self.collective.mean(pinball_loss(q, lower_scores, self.alpha))
        self.q.sub_(self.quantile_lr * grad_q)
        return self.output(ce, size, pinball, q)

    def state_tensors(self) -> list[torch.Tensor]:
        return [] if self.q is None else [self.q]

    def state_dict(self) -> dict:
        # a copy: self.q keeps changing in place after the checkpoint is taken
        return {"q": None if self.q is None else self.q.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.q = None if state["q"] is None else state["q"].clone()
