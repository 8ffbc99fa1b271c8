"""The sweep service: Ray Tune + Optuna over each method's knobs (or the paper's grid), the
paper's protocol (base model, search on validation, final re-training on seeds), Parquet results.

    from dpsm_ray.sweep import SweepSpec, run_sweep
    run_sweep(SweepSpec(name="digits", base=TrainConfig(dataset="digits", init="base")), "results/digits")
"""

from dpsm_ray.sweep.spec import SweepError, SweepInterrupted, SweepSpec


def __getattr__(name: str):
    # the protocol imports torch and Ray: only when a sweep is run (the command line validates without)
    if name in ("SweepOutOfSpace", "run_sweep"):
        from dpsm_ray.sweep import protocol

        return getattr(protocol, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["SweepError", "SweepInterrupted", "SweepOutOfSpace", "SweepSpec", "run_sweep"]
