"""Results: Parquet schemas, atomic writers, and the report."""

from dpsm_ray.results.schema import CLASSES, EPOCHS, EVALS
from dpsm_ray.results.store import write_json, write_parquet, write_run

__all__ = ["CLASSES", "EPOCHS", "EVALS", "write_json", "write_parquet", "write_run"]
