"""A tiny results directory written by hand with the real schemas: what a finished sweep leaves
(evals, epochs, classes and trials Parquet files, sweep.json), with numbers chosen so that the
report's tables can be checked against a hand computation."""

from __future__ import annotations

import json
from pathlib import Path

from dpsm_ray.storage.schema import CLASSES, EPOCHS, EVALS, TRIALS
from dpsm_ray.storage.writers import run_key, write_parquet
from dpsm_ray.sweep.collect import config_columns
from dpsm_ray.config import TrainConfig

SEEDS = (0, 1, 2)
# set size per (method, seed), the same on every re-split: CE is the best baseline (10 < CUT's 12),
# DPSM's per-seed changes against it are +0.1%, +0.2%, +0.3%
SIZES = {"base": (11.0, 11.0, 11.0), "ce": (10.0, 10.0, 10.0), "cut": (12.0, 12.0, 12.0), "dpsm": (10.01, 10.02, 10.03)}
SETTINGS = {
    "ce": {"lr": 0.02},
    "cut": {"lr": 0.03, "conformal_weight": 0.2},
    "dpsm": {"lr": 0.01, "conformal_weight": 3.24, "quantile_lr": 0.005, "sigmoid_temperature": 0.5, "q_init": "random"},
}


def config(method: str, seed: int, **values) -> TrainConfig:
    if method == "base":
        return TrainConfig(dataset="digits", method="base", init="base", epochs=0, seed=seed, base_epochs=8)
    return TrainConfig(dataset="digits", method=method, init="base", epochs=3, seed=seed, **{**SETTINGS[method], **values})


def fabricate(results: Path, *, sizes: dict = SIZES, raps_differs: bool = False, grid: bool = False, versions: bool = True, classes: int = 20,
              accuracy: dict | None = None, wsc: float = 0.85, class_conditional: bool = False) -> Path:
    """Write the directory; ``raps_differs`` makes one RAPS evaluation differ from its APS one;
    ``classes`` is K (classes.parquet's labels), ``accuracy`` a method's test accuracy in place of
    0.97, ``wsc`` every evaluation's WSC; ``class_conditional`` adds class-conditional rows beside the
    marginal ones (coverage 0.91, sets 1.5 times as large, every class covered at 0.90 to 0.92),
    which name their calibration (without it, the calibration is null, as in files written before)."""
    results.mkdir(parents=True, exist_ok=True)
    evals, per_class, epochs, trials = [], [], [], []
    for method, per_seed in sizes.items():
        for seed, size in zip(SEEDS, per_seed):
            run = config(method, seed)
            key = {"sweep": "hand", "stage": "final", "trial_id": f"{method}-{seed}", **run_key(run)}
            for score, factor in (("hps", 1.0), ("aps", 1.2), ("raps", 1.2)):
                for split in (0, 1):
                    bump = 0.01 if raps_differs and score == "raps" and method == "ce" and seed == 0 and split == 1 else 0.0
                    marginal = {"calibration": "marginal"} if class_conditional else {}
                    evals.append({**key, "score": score, **marginal, "split": split, "alpha": 0.1, "n_cal": 100, "n_test": 100, "q": 0.9,
                                  "coverage": 0.9 + 0.001 * seed, "set_size": min(classes, size * factor + bump), "covgap": 2.0, "sscv": 0.05,
                                  "wsc": wsc, "accuracy": (accuracy or {}).get(method, 0.97)})
                    for label in range(classes):
                        per_class.append({**key, "score": score, **marginal, "split": split, "label": label, "n_test": 30,
                                          "coverage": 0.85 + 0.1 * label / (classes - 1), "set_size": min(classes, size * factor)})
                    if class_conditional:
                        evals.append({**key, "score": score, "calibration": "class", "split": split, "alpha": 0.1, "n_cal": 100, "n_test": 100,
                                      "q": float("nan"), "coverage": 0.91, "set_size": min(classes, 1.5 * size * factor), "covgap": 0.5,
                                      "sscv": 0.03, "wsc": wsc, "accuracy": (accuracy or {}).get(method, 0.97)})
                        per_class += [{**key, "score": score, "calibration": "class", "split": split, "label": label, "n_test": 30,
                                       "coverage": 0.9 + 0.02 * label / (classes - 1), "set_size": min(classes, 1.5 * size * factor)}
                                      for label in range(classes)]
            if method != "base":
                for epoch in (1, 2, 3):
                    dpsm = method == "dpsm"
                    epochs.append({**key, "epoch": epoch, "lr": 0.01, "upper_loss": 3.0 if dpsm else 0.05 / epoch, "lower_loss": 0.1 if dpsm else None,
                                   "q": 0.2 if dpsm else None, "q_dataset": 0.2, "q_error": 0.1 / epoch if dpsm else None,
                                   "q_dataset_train": 0.2, "q_error_train": 0.1 / epoch if dpsm else None,
                                   "upper_gap": 0.01 * epoch if dpsm else None, "lower_gap": 0.001 * epoch if dpsm else None,
                                   "train_set_size_q": 1.0 if dpsm else None, "val_set_size": 1.1})
            trials.append(trial_row(key, run, index=len([t for t in trials if t["stage"] == "final"])))
    for method in SETTINGS:  # two search trials each: the first is the pick (its values are the final ones)
        for index, lr in enumerate((SETTINGS[method]["lr"], 0.09)):
            run = config(method, 0, lr=lr).replace(evaluate_test=False)
            key = {"sweep": "hand", "stage": "search", "trial_id": f"s-{method}-{index}", **run_key(run)}
            trials.append(trial_row(key, run, index=index, val_set_size=1.0 + index))
    write_parquet(results / "evals.parquet", evals, EVALS)
    write_parquet(results / "classes.parquet", per_class, CLASSES)
    write_parquet(results / "epochs.parquet", epochs, EPOCHS)
    write_parquet(results / "trials.parquet", trials, TRIALS)
    sweep = {"name": "hand", "base": TrainConfig(dataset="digits", init="base", epochs=3, base_epochs=8).to_dict(), "methods": list(SETTINGS),
             "trials": 2, "final_seeds": len(SEEDS), "coverage_slack": 0.02, "ranges": [["conformal_weight", {"low": 0.1, "high": 4.0, "log": True}]],
             "grid": grid, "grid_fixed": [["batch_size", 64], ["epochs", 30], ["milestones", [25]], ["lr_decay", 0.1]] if grid else [],
             "grid_subsets": [["conformal_weight", [0.1, 0.5]]] if grid else [], "grid_budget": None, "sampler": "tpe", "scheduler": "asha", "grace_period": 1,
             "reduction_factor": 3, "seed": 0, "preset": None, "ledger": 1, "studies": {m: f"hand-{m}" for m in SETTINGS}, "optuna_storage": None}
    if versions:
        sweep["versions"] = {"python": "3.11.0", "dpsm_ray": "0.0.1", "torch": "2.0.0", "ray": "2.0.0", "optuna": "5.0.0"}
    (results / "sweep.json").write_text(json.dumps(sweep))
    return results


def trial_row(key: dict, run: TrainConfig, *, index: int, val_set_size: float = 1.0) -> dict:
    return {**key, "trial_index": index, "node_ip": "127.0.0.1", "status": "ok", "error": None, "feasible": True, "val_coverage": 0.9,
            "val_set_size": val_set_size, "val_accuracy": 0.97, "epochs_completed": run.epochs, "wall_seconds": 1.0, **config_columns(run),
            "milestones": list(run.milestones), "config_json": json.dumps(run.to_dict())}
