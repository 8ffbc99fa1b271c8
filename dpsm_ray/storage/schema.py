"""Column names and types of every Parquet file (documented in docs/results.md).

Readers can rely on these: a file is written with exactly these columns, in this order, with these
types; a value a method does not have (DPSM's q for CE) is null, never a missing column.
"""

from __future__ import annotations

import pyarrow as pa

from dpsm_ray.config import TRIAL_COLUMNS, field_type

_ARROW_TYPES = {
    "float": pa.float64(),
    "int": pa.int64(),
    "str": pa.string(),
    "bool": pa.bool_(),
    "list[int]": pa.list_(pa.int64()),
    "list[str]": pa.list_(pa.string()),
}

RUN_KEY = {
    "sweep": pa.string(),  # sweep name (null for a single `dpsm-ray train` run)
    "stage": pa.string(),  # search | final (null for a single run)
    "trial_id": pa.string(),  # Tune trial id (null for a single run)
    "run_id": pa.string(),  # config hash: one per (configuration, seed)
    "dataset": pa.string(),
    "model": pa.string(),
    "method": pa.string(),
    "seed": pa.int64(),
}

EPOCHS = {
    **RUN_KEY,
    "epoch": pa.int64(),
    "lr": pa.float64(),
    "quantile_lr": pa.float64(),  # gamma: DPSM's learning rate for q per step in this epoch
    "upper_loss": pa.float64(),  # epoch mean of CE + lambda * L_c
    "ce_loss": pa.float64(),
    "conformal_loss": pa.float64(),  # L_c: soft size (ConfTr, DPSM), KS distance (CUT), 0 (CE)
    "lower_loss": pa.float64(),  # epoch mean of the pinball loss at q / tau (DPSM, ConfTr)
    "q": pa.float64(),  # DPSM's learned q at epoch end; ConfTr's mean batch tau
    "q_dataset": pa.float64(),  # Q_n: the (1 - alpha) quantile of D1 scores, eval mode
    "q_error": pa.float64(),  # |q - Q_n| (DPSM); mean |tau_batch - Q_n| (ConfTr)
    "soft_size": pa.float64(),  # soft set size of D2 at Q_n
    # the paper's figures, over the whole training split; "at q": DPSM's q, ConfTr's batch taus (averaged)
    "q_dataset_train": pa.float64(),  # Q_n of the whole training split (figure 3(a))
    "q_error_train": pa.float64(),  # |q - Q_n| against it (figure 3(a))
    "upper_loss_q": pa.float64(),  # CE + lambda * soft size at q (figure 2(c))
    "upper_loss_qn": pa.float64(),  # ... at Q_n
    "upper_gap": pa.float64(),  # upper_loss_q - upper_loss_qn
    "lower_loss_q": pa.float64(),  # pinball loss at q (figure 2(d))
    "lower_loss_qn": pa.float64(),  # ... at Q_n, its minimum
    "lower_gap": pa.float64(),  # lower_loss_q - lower_loss_qn, >= 0
    "train_soft_size_q": pa.float64(),  # soft set size of the training split at q (figure 3(b))
    "train_set_size_q": pa.float64(),  # hard set size of the training split at q (figure 3(c))
    # like for like with what a method learns from: the training scores augmented, in train mode
    "q_dataset_train_mode": pa.float64(),  # their Q_n
    "q_error_train_mode": pa.float64(),  # |q - Q_n| against it (ConfTr: batch taus recomputed from them)
    "q_dataset_train_mode_d1": pa.float64(),  # the Q_n of their D1 part alone: what DPSM's lower level fits
    "q_error_train_mode_d1": pa.float64(),  # |q - Q_n| against that
    # at the epoch's first batch, before its step (epoch 1: the run's first step)
    "ce_grad_norm": pa.float64(),  # the gradient norm of the CE term
    "size_grad_norm": pa.float64(),  # ... of the size term lambda x L_c (NaN where the loss is not CE + size)
    "val_coverage": pa.float64(),
    "val_set_size": pa.float64(),
    "val_accuracy": pa.float64(),
    "epoch_seconds": pa.float64(),
    "train_seconds": pa.float64(),  # the epoch's steps, data included
    "diagnostics_seconds": pa.float64(),  # the columns q_dataset ... train_set_size_q
    "validation_seconds": pa.float64(),  # the val_ columns
}

EVALS = {
    **RUN_KEY,
    "score": pa.string(),
    "calibration": pa.string(),  # marginal (one threshold) | class (one per class) | cluster | rc3p; null in rows written before class
    "split": pa.int64(),
    "alpha": pa.float64(),
    "n_cal": pa.int64(),
    "n_test": pa.int64(),
    "q": pa.float64(),  # the marginal threshold; NaN for the others' rows (classes.parquet holds each class's)
    "coverage": pa.float64(),
    "set_size": pa.float64(),
    "covgap": pa.float64(),
    "sscv": pa.float64(),
    "wsc": pa.float64(),
    "accuracy": pa.float64(),
    # null in rows written before these columns (docs/results.md defines each)
    "empty_rate": pa.float64(),  # the fraction of empty sets
    "singleton_rate": pa.float64(),  # the fraction of sets of one class
    "classes_under": pa.int64(),  # classes (with a test point) covered below 1 - alpha
    "class_coverage_min": pa.float64(),  # the lowest coverage of a class
    "class_coverage_max": pa.float64(),  # the highest
    "ece": pa.float64(),  # the top-label expected calibration error of the probabilities (15 bins)
}

CLASSES = {
    **RUN_KEY,
    "score": pa.string(),
    "calibration": pa.string(),  # marginal | class | cluster | rc3p, as evals.parquet's
    "split": pa.int64(),
    "label": pa.int64(),  # the class
    "class_name": pa.string(),  # its name, where the dataset has names (null otherwise)
    "n_cal": pa.int64(),  # the class's points in the calibration part of the re-split
    "n_test": pa.int64(),  # the class's points in the test part of the re-split
    "q": pa.float64(),  # the threshold its label was held to: the marginal q, or the class's own (inf: too few n_cal)
    "coverage": pa.float64(),  # class-conditional coverage (null when n_test is 0)
    "set_size": pa.float64(),  # average set size over the class's test points (null when n_test is 0)
}

TRIALS = {
    **RUN_KEY,
    "trial_index": pa.int64(),  # position in its stage, in the order the searcher proposed it (seed-fixed, unlike trial_id)
    "node_ip": pa.string(),  # the Ray node the trial's own process last ran on
    "device": pa.string(),  # the torch device it trained on: cpu, cuda:0, ... (rank 0's for a DDP trial)
    "gpu_ids": pa.string(),  # the GPU ids Ray assigned to its process, comma-separated (null without a GPU share)
    "status": pa.string(),  # ok | stopped (early, by ASHA) | failed
    "error": pa.string(),  # last line of the error for failed trials
    "feasible": pa.bool_(),  # val_coverage >= 1 - alpha - slack
    "val_coverage": pa.float64(),
    "val_set_size": pa.float64(),  # the search objective (minimised)
    "val_accuracy": pa.float64(),
    "epochs_completed": pa.int64(),
    "wall_seconds": pa.float64(),
    # the configuration: the fields marked ``column`` (dpsm_ray/config.py), null where a method does not read one
    **{name: _ARROW_TYPES[field_type(name)] for name in TRIAL_COLUMNS},
    "config_json": pa.string(),  # the whole TrainConfig
}


def arrow_schema(columns: dict[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field(name, kind) for name, kind in columns.items()])
