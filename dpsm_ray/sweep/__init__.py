"""The sweep service: Ray Tune + Optuna over each method's knobs (or the paper's grid), the
paper's protocol (base model, search on validation, final re-training on seeds), Parquet results.

    from dpsm_ray.sweep import SweepSpec, run_sweep
    run_sweep(SweepSpec(name="digits", base=TrainConfig(dataset="digits", init="base")), "results/digits")

The names load on first use, so that ``dpsm_ray.sweep.options`` can refuse a bad command line
before torch and Ray are imported (seconds on a busy machine).
"""

from dpsm_ray.lazy import handed_on

HANDED_ON = {"SweepOutOfSpace": "driver", "run_sweep": "driver", "SweepError": "spec", "SweepInterrupted": "spec", "SweepSpec": "spec"}


__getattr__ = handed_on(__name__, HANDED_ON)


__all__ = ["SweepError", "SweepInterrupted", "SweepOutOfSpace", "SweepSpec", "run_sweep"]
