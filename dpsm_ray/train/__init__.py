"""Training: the one loop, and where it runs (this process or Ray Train workers).

The loop's names are imported when first used: ``dpsm_ray.config`` (what the command line
validates with) stays free of torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dpsm_ray.config import ConfigError, TrainConfig
from dpsm_ray.lazy import handed_on

if TYPE_CHECKING:
    from dpsm_ray.train.loop import RunResult

HANDED_ON = {"LocalEnv": "env", "pick_device": "env", "DivergedError": "loop", "RunResult": "loop", "train": "loop"}


__getattr__ = handed_on(__name__, HANDED_ON)


def run_training(config: TrainConfig, out_dir: str | os.PathLike | None = None, log=None, **ray_options) -> RunResult:
    """Train ``config`` in this process (``workers == 0``) or on Ray Train workers
    (``ray_options``: ``train_distributed``'s keywords).  With ``out_dir`` the run checkpoints
    there and resumes from an existing checkpoint.  With ``init="base"`` the CE base model comes
    from the cache (trained first on a miss)."""
    from dpsm_ray.storage.layout import CHECKPOINT_FILE
    from dpsm_ray.train.env import LocalEnv, pick_device
    from dpsm_ray.train.loop import train

    config = resolve_base_model(config, log, **ray_options)
    checkpoint = Path(out_dir) / CHECKPOINT_FILE if out_dir is not None else None
    if config.workers == 0:
        return train(config, LocalEnv(pick_device(config.device), checkpoint, log=log))
    from dpsm_ray.train.ray_train import train_distributed

    return train_distributed(config, out_dir, log=log, **ray_options)


def resolve_base_model(config: TrainConfig, log=None, **ray_options) -> TrainConfig:
    """``config`` with ``init_checkpoint`` pointing at its CE base model when ``init="base"``
    (trained and cached on first use, with the same workers as ``config``)."""
    from dpsm_ray.storage import write_run
    from dpsm_ray.train.base_model import ensure_base_model

    def train_and_write(base: TrainConfig, base_dir) -> None:
        write_run(base_dir, run_training(base, base_dir, log, **ray_options))

    return ensure_base_model(config, train_and_write, config.cache_dir, log=log or _stderr)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["ConfigError", "DivergedError", "LocalEnv", "RunResult", "TrainConfig", "resolve_base_model", "run_training", "train"]
