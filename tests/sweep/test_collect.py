"""Rows rebuilt from a trial's reported history (no Ray)."""

import pandas as pd

from dpsm_ray.sweep.collect import epoch_rows
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
