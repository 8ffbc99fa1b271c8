"""Training: the config, the one loop, and where it runs (this process or Ray Train workers)."""

from __future__ import annotations

import os
from pathlib import Path

from dpsm_ray.train.config import ConfigError, TrainConfig
from dpsm_ray.train.env import LocalEnv, pick_device
from dpsm_ray.train.loop import DivergedError, RunResult, train


def run_training(config: TrainConfig, out_dir: str | os.PathLike | None = None, log=None) -> RunResult:
    """Train ``config`` in this process (``workers == 0``) or on Ray Train workers.  With
    ``out_dir`` the run checkpoints there and resumes from an existing checkpoint."""
    checkpoint = Path(out_dir) / "checkpoint.pt" if out_dir is not None else None
    if config.workers == 0:
        return train(config, LocalEnv(pick_device(config.device), checkpoint, log=log))
    from dpsm_ray.train.ray_train import train_distributed

    return train_distributed(config, out_dir, log=log)


__all__ = ["ConfigError", "DivergedError", "LocalEnv", "RunResult", "TrainConfig", "run_training", "train"]
