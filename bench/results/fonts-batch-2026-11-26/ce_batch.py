"""Is DPSM's batch-32 result on fonts the size term's, or the batch's? (the decisive study's
dpsm_l05_b32 / dpsm_l05_b512 arms change the batch at the same lr and epochs, so the number of SGD
steps changes with it: 4x at batch 32, 1/4 at 512).

Trains CE fine-tuned -- the study's `ce` arm of a seed, its own record.json in
results/decisive-fonts, from the same cached base model -- at batch 32 and 512 with everything
else unchanged, and prints one JSON line per model: its last epoch's validation accuracy and set
size, and the test HPS/APS set size, coverage and accuracy over the study's 10 re-splits (the
study's final evaluation), beside DPSM's model of the same seed and batch from the study's
committed compact results (docs/results/decisive-fonts/evals.csv).

    .venv/bin/python bench/results/fonts-batch-2026-11-26/ce_batch.py SEED [SEED ...]
"""

import json
import sys

import pandas as pd
import torch

from dpsm_ray.config import TrainConfig
from dpsm_ray.train import run_training

torch.set_num_threads(1)
STUDY = "results/decisive-fonts"
evals = pd.read_csv("docs/results/decisive-fonts/evals.csv")


def test_row(rows: pd.DataFrame, prefix: str) -> dict:
    out = {}
    for score in ("hps", "aps"):
        part = rows[rows.score == score]
        out[f"{prefix}_{score}_size"] = round(float(part.set_size.mean()), 3)
        out[f"{prefix}_{score}_coverage"] = round(float(part.coverage.mean()), 4)
    out[f"{prefix}_accuracy"] = round(float(rows.accuracy.mean()), 4)
    return out


for seed in map(int, sys.argv[1:]):
    record = json.load(open(f"{STUDY}/runs/ce/{seed:04d}/record.json"))["payload"]["config"]
    for batch in (32, 512):
        config = TrainConfig.from_dict({**record, "batch_size": batch, "cache_dir": f"{STUDY}/base_models"})
        result = run_training(config, log=lambda line: None)
        last = result.epochs[-1]
        row = {"seed": seed, "batch": batch, "ce_val_accuracy": round(last["val_accuracy"], 4),
               "ce_val_set_size": round(last["val_set_size"], 3), **test_row(pd.DataFrame(result.evals), "ce")}
        dpsm = evals[(evals.stage == f"dpsm_l05_b{batch}") & (evals.seed == seed)]
        row.update(test_row(dpsm, "dpsm"))
        print(json.dumps(row), flush=True)
