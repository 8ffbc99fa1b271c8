"""The sweep service: Ray Tune + Optuna over each method's knobs (or the paper's grid), the
paper's protocol (base model, search on validation, final re-training on seeds), Parquet results.

    from dpsm_ray.sweep import SweepSpec, run_sweep
    run_sweep(SweepSpec(name="digits", base=TrainConfig(dataset="digits", init="base")), "results/digits")
"""

from dpsm_ray.sweep.protocol import SweepError, SweepInterrupted, SweepSpec, run_sweep

__all__ = ["SweepError", "SweepInterrupted", "SweepSpec", "run_sweep"]
