"""Storage: where a run's and a sweep's files live (``layout``: the results directory's names, its
ledger, index, lock and manifest), the Parquet files' columns (``schema``) and their atomic writers
(``writers``).  What training and sweeps write and every reader opens; the reporting on top of it
is ``dpsm_ray.results``.

The names below are imported when first used: ``layout``, which a sweep script's ``--help`` reads
(the results directory's file names), stays free of pandas and pyarrow.
"""

from dpsm_ray.lazy import handed_on

HANDED_ON = {"CLASSES": "schema", "EPOCHS": "schema", "EVALS": "schema", "write_json": "writers", "write_parquet": "writers",
             "write_run": "writers"}


__getattr__ = handed_on(__name__, HANDED_ON)


__all__ = ["CLASSES", "EPOCHS", "EVALS", "write_json", "write_parquet", "write_run"]
