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


class ProcessGroupEnv(LocalEnv):
    """One worker of an initialised ``torch.distributed`` process group: DDP for the model, the
    distributed collective for the objectives, logging and checkpointing from rank 0 only."""

    def __init__(self, device: torch.device, checkpoint_path=None, log=None) -> None:
        super().__init__(device, checkpoint_path, log)
        from dpsm_ray.collective import current_collective

        self.collective = current_collective()

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.collective.world_size == 1:
            return model
        device_ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def report(self, row: dict, checkpoint: dict | None) -> None:
        if self.collective.rank == 0:
            super().report(row, checkpoint)

    def log(self, line: str) -> None:
        if self.collective.rank == 0:
            super().log(line)

    def check_in_sync(self, model, objective) -> None:
        """Every worker must hold bit-identical parameters and q after each step."""
        from dpsm_ray.train.loop import unwrap

        parts = [p.detach().double().sum() for p in unwrap(model).parameters()]
        state = objective.state_dict()
        if state.get("q") is not None:
            parts.append(state["q"].double().to(parts[0].device))
        local = torch.stack(parts)
        gathered = self.collective.gather_uneven(local[None], [1] * self.collective.world_size)
        if not (gathered == gathered[0]).all():
            raise RuntimeError(f"workers diverged: parameter/q checksums differ across ranks:\n{gathered}")
