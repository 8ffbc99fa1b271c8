"""Results: the results directory (``layout``), Parquet schemas, atomic writers, and the report.

The names below are imported when first used: ``layout``, which a sweep script's ``--help`` reads
(the results directory's file names), stays free of pandas and pyarrow.
"""

LAZY = {"CLASSES": "schema", "EPOCHS": "schema", "EVALS": "schema", "write_json": "store", "write_parquet": "store", "write_run": "store"}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(f"dpsm_ray.results.{LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLASSES", "EPOCHS", "EVALS", "write_json", "write_parquet", "write_run"]
