"""Rows rebuilt from a trial's reported history, and the choice of a best configuration (no Ray)."""

import json

import pandas as pd

from dpsm_ray.results.schema import TRIALS
from dpsm_ray.results.store import write_parquet
from dpsm_ray.sweep.collect import epoch_rows
from dpsm_ray.sweep.protocol import SweepSpec, best_overrides
from dpsm_ray.train.config import TrainConfig
from dpsm_ray.train.ray_train import FINISHED


def test_epochs_reported_twice_after_a_restart_count_once_keeping_the_later_report():
    # a run checkpointed after epoch 1, reported epochs 1-2, crashed, and resumed from epoch 1
    history = pd.DataFrame([
        {"epoch": 1, "val_coverage": 0.90},
        {"epoch": 2, "val_coverage": 0.80},
        {"epoch": 2, "val_coverage": 0.91},
        {"epoch": 3, "val_coverage": 0.92},
        {"epoch": 3, FINISHED: True, "val_coverage": 0.92},
    ])
    rows = epoch_rows(history)
    assert [(r["epoch"], r["val_coverage"]) for r in rows] == [(1, 0.90), (2, 0.91), (3, 0.92)]
    assert epoch_rows(None) == [] and epoch_rows(pd.DataFrame()) == []


def test_ties_for_the_best_configuration_go_to_the_trial_proposed_first(tmp_path):
    """Equal validation set size and coverage are common on a ~300-point validation split; Tune's
    trial ids are random per run, so they must not decide (issue 13: the same seed picked lr 0.0221
    in one run and 0.0257 in another)."""
    spec = SweepSpec(name="tie", base=TrainConfig(dataset="digits"), methods=("dpsm",), trials=3)
    config = spec.base.replace(method="dpsm")
    rows = [
        {"stage": "search", "method": "dpsm", "trial_id": trial_id, "trial_index": index, "status": "ok", "feasible": True,
         "val_set_size": size, "val_coverage": 0.9173, "milestones": [], "config_json": json.dumps(config.replace(lr=lr).to_dict())}
        for trial_id, index, lr, size in [("f0c1", 0, 0.0257, 0.9373), ("a9d2", 1, 0.0221, 0.9373), ("0b3e", 2, 0.05, 0.95)]
    ]
    write_parquet(tmp_path / "trials.parquet", rows, TRIALS)
    lines = []
    chosen = best_overrides(spec, tmp_path, "dpsm", lines.append)
    assert chosen["lr"] == 0.0257 and "trial f0c1" in lines[0]
    # without a feasible trial: the highest coverage, ties again to the first proposed
    write_parquet(tmp_path / "trials.parquet", [{**row, "feasible": False} for row in rows], TRIALS)
    assert best_overrides(spec, tmp_path, "dpsm", lines.append)["lr"] == 0.0257
