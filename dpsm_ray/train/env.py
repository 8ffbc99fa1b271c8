"""Where a training run executes: in this process (``LocalEnv``) or as a Ray Train worker
(``dpsm_ray.train.ray_worker``).  The loop talks only to this interface:

    collective, device, prepare_model(model), load_state(), report(row, checkpoint), log(line),
    check_in_sync(model, objective)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from dpsm_ray.collective import LocalCollective


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} was asked for, but torch sees no CUDA device")
    return torch.device(name)


class LocalEnv:
    """One process.  With ``checkpoint_path``, each checkpoint is saved there (atomically) and a
    run started again with the same path resumes from it."""

    def __init__(self, device: torch.device, checkpoint_path: str | os.PathLike | None = None, log=None) -> None:
        self.collective = LocalCollective()
        self.device = device
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self._log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def load_state(self) -> dict | None:
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return None
        return torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)

    def report(self, row: dict, checkpoint: dict | None) -> None:
        if checkpoint is None or self.checkpoint_path is None:
            return
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        torch.save(checkpoint, tmp)
        os.replace(tmp, self.checkpoint_path)

    def log(self, line: str) -> None:
        self._log(line)

    def check_in_sync(self, model, objective) -> None:
        """Nothing to compare with one process."""
