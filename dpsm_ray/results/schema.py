"""Column names and types of every Parquet file (documented in docs/results.md).

Readers can rely on these: a file is written with exactly these columns, in this order, with these
types; a value a method does not have (DPSM's q for CE) is null, never a missing column.
"""

from __future__ import annotations

import pyarrow as pa

RUN_KEY = {
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
    "upper_loss": pa.float64(),  # epoch mean of CE + lambda * L_c
    "ce_loss": pa.float64(),
    "conformal_loss": pa.float64(),  # L_c: soft size (ConfTr, DPSM), KS distance (CUT), 0 (CE)
    "lower_loss": pa.float64(),  # epoch mean of the pinball loss at q / tau (DPSM, ConfTr)
    "q": pa.float64(),  # DPSM's learned q at epoch end; ConfTr's mean batch tau
    "q_dataset": pa.float64(),  # Q_n: the (1 - alpha) quantile of D1 scores, eval mode
    "q_error": pa.float64(),  # |q - Q_n| (DPSM); mean |tau_batch - Q_n| (ConfTr)
    "soft_size": pa.float64(),  # soft set size of D2 at Q_n
    "val_coverage": pa.float64(),
    "val_set_size": pa.float64(),
    "val_accuracy": pa.float64(),
    "epoch_seconds": pa.float64(),
}

EVALS = {
    **RUN_KEY,
    "score": pa.string(),
    "split": pa.int64(),
    "alpha": pa.float64(),
    "n_cal": pa.int64(),
    "n_test": pa.int64(),
    "q": pa.float64(),
    "coverage": pa.float64(),
    "set_size": pa.float64(),
    "covgap": pa.float64(),
    "sscv": pa.float64(),
    "wsc": pa.float64(),
    "accuracy": pa.float64(),
}


def arrow_schema(columns: dict[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field(name, kind) for name, kind in columns.items()])
