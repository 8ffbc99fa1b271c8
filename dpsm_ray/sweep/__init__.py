"""The sweep service: Ray Tune + Optuna over each method's knobs (or the paper's grid), the
paper's protocol (base model, search on validation, final re-training on seeds), Parquet results.

    from dpsm_ray.sweep import SweepSpec, run_sweep
    run_sweep(SweepSpec(name="digits", base=TrainConfig(dataset="digits", init="base")), "results/digits")

The names load on first use, so that ``dpsm_ray.sweep.options`` can refuse a bad command line
before torch and Ray are imported (seconds on a busy machine).
"""

_NAMES = {
    "SweepOutOfSpace": "dpsm_ray.sweep.protocol", "run_sweep": "dpsm_ray.sweep.protocol",
    "SweepError": "dpsm_ray.sweep.spec", "SweepInterrupted": "dpsm_ray.sweep.spec", "SweepSpec": "dpsm_ray.sweep.spec",
}


def __getattr__(name: str):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'dpsm_ray.sweep' has no attribute {name!r}")


__all__ = ["SweepError", "SweepInterrupted", "SweepOutOfSpace", "SweepSpec", "run_sweep"]
