"""Results: the results directory (``layout``), Parquet schemas, atomic writers, and the report.

The names below are imported when first used: ``layout``, which a sweep script's ``--help`` reads
(the results directory's file names), stays free of pandas and pyarrow.
"""

from dpsm_ray.lazy import handed_on

HANDED_ON = {"CLASSES": "schema", "EPOCHS": "schema", "EVALS": "schema", "write_json": "store", "write_parquet": "store",
             "write_run": "store"}


__getattr__ = handed_on(__name__, HANDED_ON)


__all__ = ["CLASSES", "EPOCHS", "EVALS", "write_json", "write_parquet", "write_run"]
