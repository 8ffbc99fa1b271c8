"""Where a training run executes: in this process (``LocalEnv``) or as a Ray Train worker
(``dpsm_ray.train.ray_train``).  The loop talks only to this interface:

    collective, device, prepare_model(model), load_state(), report(row, checkpoint), log(line),
    check_in_sync(model, objective)
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import torch

from dpsm_ray.collective import LocalCollective
from dpsm_ray.files import CorruptFileError, atomic_write
from dpsm_ray.timing import Stopwatch


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} was asked for, but torch sees no CUDA device")
    return torch.device(name)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint this service wrote: tensors in plain containers, read with
    ``weights_only=True`` -- a results directory may be writable by others (a cluster's shared
    file system), and nothing in it is ever unpickled.  ``CorruptFileError`` names the file when it
    holds anything else or is truncated."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CorruptFileError(path, "is not a checkpoint this service wrote: it holds Python objects, which are never unpickled "
                                     "(weights_only); delete it to train that run again") from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise CorruptFileError(
            path, f"cannot be read as a checkpoint ({str(error).splitlines()[0][:120]}); delete it to train that run again"
        ) from None


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    atomic_write(path, lambda handle: torch.save(state, handle))


class LocalEnv:
    """One process.  With ``checkpoint_path``, each checkpoint is saved there (atomically) and a
    run started again with the same path resumes from it."""

    def __init__(self, device: torch.device, checkpoint_path: str | os.PathLike | None = None, log=None) -> None:
        self.collective = LocalCollective()
        self.device = device
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.clock = Stopwatch()  # where the run's time goes, outside the epochs' own epoch_seconds too
        self._log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def load_state(self) -> dict | None:
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return None
        return load_checkpoint(self.checkpoint_path)

    def report(self, row: dict, checkpoint: dict | None, epochs: list[dict] | None = None) -> None:
        """After each epoch: its row, the checkpoint when one is due, and every epoch row so far."""
        if checkpoint is not None and self.checkpoint_path is not None:
            save_checkpoint(self.checkpoint_path, checkpoint)

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
        device_ids = (
            [self.device.index if self.device.index is not None else torch.cuda.current_device()] if self.device.type == "cuda" else None
        )
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def report(self, row: dict, checkpoint: dict | None, epochs: list[dict] | None = None) -> None:
        if self.collective.rank == 0:
            super().report(row, checkpoint, epochs)

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
