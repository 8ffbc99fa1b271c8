"""trials.parquet's rows from hand-written run records (no Ray): a knob a method does not read is null."""

from dpsm_ray.storage.layout import CoverageFloor

from dpsm_ray.config import TRIAL_COLUMNS
from dpsm_ray.sweep.collect import collect
from dpsm_ray.storage.layout import Ledger
from dpsm_ray.config import TrainConfig


def record(method: str, index: int) -> dict:
    config = TrainConfig(dataset="digits", method=method, conformal_weight=0.5, sigmoid_temperature=0.1, quantile_lr=0.01, epochs=2, evaluate_test=False)
    return {"trial_id": f"{method}{index}", "node_ip": "127.0.0.1", "status": "ok", "error": None, "wall_seconds": 1.0, "epochs_completed": 0,
            "metrics": {"val_coverage": 0.9, "val_set_size": 1.1, "val_accuracy": 0.95}, "config": config.to_dict()}


def test_a_knob_the_method_does_not_read_is_null(tmp_path):
    ledger = Ledger(tmp_path)
    for index, method in enumerate(("ce", "cut", "conftr", "dpsm")):
        ledger.write_record("search-all", index, record(method, index))
    rows = {row["method"]: row for row in collect("hand", CoverageFloor(0.1, 0.02), ledger, "search", "search-all")["trials"]}
    # CE reads none of the conformal knobs, though its config holds lambda 0.5 and T 0.1
    ce = rows["ce"]
    assert [ce[c] for c in ("conformal_weight", "sigmoid_temperature", "quantile_lr", "sort_temperature", "q_init", "cut_score", "ce_batch")] == [None] * 7
    assert (ce["lr"], ce["epochs"], ce["alpha"], ce["lr_schedule"]) == (0.05, 2, 0.1, "step")  # what every method reads
    assert (rows["cut"]["conformal_weight"], rows["cut"]["sigmoid_temperature"], rows["cut"]["cut_score"], rows["cut"]["q_init"]) == (0.5, None, "hps", None)
    assert (rows["conftr"]["sigmoid_temperature"], rows["conftr"]["conftr_split"], rows["conftr"]["quantile_lr"]) == (0.1, "batch", None)
    dpsm = rows["dpsm"]
    assert (dpsm["conformal_weight"], dpsm["sigmoid_temperature"], dpsm["quantile_lr"], dpsm["q_init"], dpsm["sort_temperature"]) == (0.5, 0.1, 0.01, "dataset", None)
    assert all(column in ce for column in TRIAL_COLUMNS)  # null, never a missing column
