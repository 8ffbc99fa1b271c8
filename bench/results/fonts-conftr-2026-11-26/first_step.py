"""Where ConfTr's first fine-tuning step sends its gradient on fonts (the decisive study's
conftr_l05 and dpsm_l05 arms: lambda 0.5, T 0.1, lr 0.1, from the study's base model of a seed).

Runs the study's own configuration of a trial (its record.json in results/decisive-fonts) through
the training loop and prints, for its first batch, the gradient norm of each part of the loss as a
JSON line:
  ce                         CE on the whole batch
  lambda_size                lambda x the soft set size (ConfTr: at tau, the smooth batch quantile)
  lambda_size_hard_quantile  ConfTr's term at the exact order statistic instead
  lambda_size_tau_detached   ConfTr's term with tau held constant (only B2's scores feel it)
  dsize_dtau                 the soft set size's derivative in tau (<= K x 0.25 / T = 352 at K 141)
then takes the loop's real steps (at most 8) and prints each: its losses, the largest |logit| of
the batch after the step before, and the gradient norm, until the loss is not finite.

    .venv/bin/python bench/results/fonts-conftr-2026-11-26/first_step.py SEED
"""

import json
import math
import sys

import torch

import dpsm_ray.train.step as step_module
from dpsm_ray.config import TrainConfig
from dpsm_ray.conformal import hard_batch_quantile, label_scores, soft_set_size
from dpsm_ray.objectives.base import hps_scores, step_cross_entropy
from dpsm_ray.train import run_training

torch.set_num_threads(1)
SEED = int(sys.argv[1])
WEIGHT = 0.5
STEPS = []  # ConfTr's real steps, after the first batch's measurement


class FirstStep(Exception):
    pass


def norm(model, loss) -> float:
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True, allow_unused=True)
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))


def measure(self, x1, y1, x2, y2):
    model, objective = self.model, self.objective
    if STEPS:
        return trajectory(self, x1, y1, x2, y2)
    logits1, logits2 = model(x1), model(x2)
    ce = step_cross_entropy("full", logits1, y1, logits2, y2)
    row = {"seed": SEED, "method": type(objective).__name__, "ce": norm(model, ce)}
    if row["method"] == "ConfTr":
        calibration = label_scores(hps_scores(logits1), y1)
        tau = objective.batch_quantile(calibration)
        size = soft_set_size(hps_scores(logits2), tau, objective.sigmoid_temperature)
        free = tau.detach().clone().requires_grad_()
        row.update(
            tau=float(tau.detach()),
            size=float(size.detach()),
            lambda_size=norm(model, WEIGHT * size),
            lambda_size_hard_quantile=norm(
                model,
                WEIGHT
                * soft_set_size(hps_scores(logits2), hard_batch_quantile(calibration, objective.alpha), objective.sigmoid_temperature),
            ),
            lambda_size_tau_detached=norm(model, WEIGHT * soft_set_size(hps_scores(logits2), tau.detach(), objective.sigmoid_temperature)),
            dsize_dtau=float(
                torch.autograd.grad(soft_set_size(hps_scores(logits2).detach(), free, objective.sigmoid_temperature), free)[0]
            ),
        )
    else:
        out = objective(logits1, y1, logits2, y2)
        row.update(q=float(out.stats["quantile"]), size=float(out.stats["conformal"]), lambda_size=norm(model, out.loss - ce))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if row["method"] != "ConfTr":
        raise FirstStep
    return trajectory(self, x1, y1, x2, y2)


def trajectory(self, x1, y1, x2, y2):
    out = step_module.forward_objective(self.model, self.objective, x1, y1, x2, y2, self.precision, self.channels_last)
    self.optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    with torch.no_grad():
        row = {
            "seed": SEED,
            "step": len(STEPS),
            **{k: float(out.stats[k]) for k in ("ce", "conformal", "quantile")},
            "max_abs_logit": float(self.model(torch.cat([x1, x2])).abs().max()),
            "grad_norm": math.sqrt(sum(float(p.grad.pow(2).sum()) for p in self.model.parameters() if p.grad is not None)),
        }
    STEPS.append(row)
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if not math.isfinite(row["ce"]) or len(STEPS) == 8:
        raise FirstStep
    self.optimizer.step()
    return out.stats


step_module.EagerStep.__call__ = measure
for arm in ("conftr_l05", "dpsm_l05"):
    STEPS.clear()
    record = json.load(open(f"results/decisive-fonts/runs/{arm}/{SEED:04d}/record.json"))["payload"]["config"]
    record.update(cache_dir="results/decisive-fonts/base_models", epochs=1, evaluate_test=False, step="eager")
    try:
        run_training(TrainConfig.from_dict(record), log=lambda line: None)
    except FirstStep:
        pass
