"""The choice of a best configuration (no Ray)."""

import json


from dpsm_ray.storage.schema import EPOCHS, TRIALS
from dpsm_ray.storage.writers import write_parquet
from dpsm_ray.sweep.pick import best_overrides
from dpsm_ray.sweep.spec import SweepSpec
from dpsm_ray.config import TrainConfig

KNOBS = ("conformal_weight", "lr", "quantile_lr", "sigmoid_temperature")  # DPSM's: what its search sets


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
    chosen = best_overrides(tmp_path, "dpsm", KNOBS, lines.append)
    assert chosen["lr"] == 0.0257 and "search trial 1 " in lines[0]
    # without a feasible trial: the highest coverage, ties again to the first proposed
    write_parquet(tmp_path / "trials.parquet", [{**row, "feasible": False} for row in rows], TRIALS)
    assert best_overrides(tmp_path, "dpsm", KNOBS, lines.append)["lr"] == 0.0257


def test_a_trial_asha_stopped_is_picked_only_if_it_was_ahead_at_the_same_epoch_budget(tmp_path):
    spec = SweepSpec(name="asha", base=TrainConfig(dataset="digits"), methods=("dpsm",), trials=4, scheduler="asha")
    config = spec.base.replace(method="dpsm")

    def trial(trial_id, index, status, lr, size, epochs_completed, feasible=True):
        return {"stage": "search", "method": "dpsm", "trial_id": trial_id, "trial_index": index, "status": status, "feasible": feasible,
                "val_set_size": size, "val_coverage": 0.91 if feasible else 0.8, "epochs_completed": epochs_completed, "milestones": [],
                "config_json": json.dumps(config.replace(lr=lr).to_dict())}

    def epochs(trial_id, sizes):
        return [{"stage": "search", "method": "dpsm", "trial_id": trial_id, "epoch": e + 1, "val_set_size": size} for e, size in enumerate(sizes)]

    finished = trial("f", 0, "ok", 0.01, 0.95, 10)
    behind = trial("s1", 1, "stopped", 0.02, 1.20, 2)  # the finished trial had 1.10 after 2 epochs
    ahead = trial("s2", 2, "stopped", 0.03, 1.05, 2)
    further_ahead_but_infeasible = trial("s3", 3, "stopped", 0.04, 0.50, 2, feasible=False)
    write_parquet(tmp_path / "epochs.parquet", epochs("f", [1.5, 1.10] + [1.0] * 7 + [0.95]), EPOCHS)
    lines = []

    write_parquet(tmp_path / "trials.parquet", [finished, behind, further_ahead_but_infeasible], TRIALS)
    assert best_overrides(tmp_path, "dpsm", KNOBS, lines.append)["lr"] == 0.01  # behind at its budget: the finished trial stays
    write_parquet(tmp_path / "trials.parquet", [finished, behind, ahead], TRIALS)
    assert best_overrides(tmp_path, "dpsm", KNOBS, lines.append)["lr"] == 0.03  # 1.05 after 2 epochs against the pick's 1.10
    assert "trial s2, stopped after 2 epochs, was 0.050 ahead" in "\n".join(lines)
    # no finished feasible trial: the feasible stopped one that ran longest
    longer = trial("s4", 4, "stopped", 0.05, 1.30, 6)
    write_parquet(tmp_path / "trials.parquet", [trial("f", 0, "ok", 0.01, 0.95, 10, feasible=False), ahead, longer], TRIALS)
    assert best_overrides(tmp_path, "dpsm", KNOBS, lines.append)["lr"] == 0.05
