"""Ray Train glue: the same loop on ``TorchTrainer`` workers (DDP; nccl on GPUs, gloo on CPU).

Checkpoints go through Ray Train's storage (``RunConfig.storage_path``), so they survive a worker
crash: with ``FailureConfig(max_failures=N)`` Ray restarts the worker group, which resumes from
``ray.train.get_checkpoint()``.  The run's name is the config hash, so starting the same run again
continues it.  The last checkpoint also carries the run's results, which is how the driver gets
them back without a shared filesystem between worker and driver nodes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from dpsm_ray.train.config import TrainConfig
from dpsm_ray.train.env import LocalEnv, ProcessGroupEnv
from dpsm_ray.train.loop import RunResult, train
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S, check_before_start, check_capacity, ensure_ray, run_demand

STATE_FILE = "state.pt"
RESULT_FILE = "result.pt"
# Marks the last report (the results).  Not "done": Tune reads "done" as "stop this trial" and
# would kill the trial driver while its Train run is still shutting down (leaking its placement group).
FINISHED = "run_finished"


class RayCheckpointing:
    """Reports and checkpoints through a Ray session (Train or Tune).  Every rank reports equally
    often (``ray.train.report`` is a barrier); only rank 0 attaches a checkpoint.  The last
    report's checkpoint holds the final training state and the run's results."""

    _report_fn: Callable  # ray.train.report or ray.tune.report
    _get_checkpoint_fn: Callable  # ray.train.get_checkpoint or ray.tune.get_checkpoint
    _checkpoint_cls: type  # ray.train.Checkpoint or ray.tune.Checkpoint
    inject_failure: dict | None = None
    _last_state: dict | None = None

    def load_state(self) -> dict | None:
        checkpoint = self._get_checkpoint_fn()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            return torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)

    def report(self, row: dict, checkpoint: dict | None) -> None:
        if checkpoint is not None:
            self._last_state = checkpoint
        self._report(row, {STATE_FILE: checkpoint} if checkpoint is not None else {})
        failure = self.inject_failure
        if failure and row["epoch"] == failure["after_epoch"] and self.collective.rank == failure["rank"]:
            marker = Path(failure["marker"])
            if not marker.exists():  # fail on the first attempt only
                marker.write_text("injected")
                os.kill(os.getpid(), signal.SIGKILL)

    def finish(self, result: RunResult) -> None:
        """One last report whose checkpoint holds the results (and the final training state)."""
        payload = {field.name: getattr(result, field.name) for field in dataclasses.fields(result) if field.name != "config"}
        metrics = {"epoch": len(result.epochs), FINISHED: True}
        if result.epochs:
            metrics.update({k: v for k, v in result.epochs[-1].items() if k != "epoch"})
        self._report(metrics, {STATE_FILE: self._last_state, RESULT_FILE: payload})

    def _report(self, metrics: dict, files: dict) -> None:
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = None
            if files and self.collective.rank == 0:
                for name, payload in files.items():
                    torch.save(payload, Path(directory) / name)
                checkpoint = self._checkpoint_cls.from_directory(directory)
            self._report_fn(metrics, checkpoint=checkpoint)


class RayTrainEnv(RayCheckpointing, ProcessGroupEnv):
    """A Ray Train worker (DDP over the worker group)."""

    def __init__(self, inject_failure: dict | None = None) -> None:
        import ray.train
        import ray.train.torch

        super().__init__(ray.train.torch.get_device())
        self._report_fn, self._get_checkpoint_fn, self._checkpoint_cls = ray.train.report, ray.train.get_checkpoint, ray.train.Checkpoint
        self.inject_failure = inject_failure


class TuneTrialEnv(RayCheckpointing, LocalEnv):
    """A Tune trial that trains in its own process, without a Ray Train worker group."""

    def __init__(self, device: torch.device) -> None:
        from ray import tune

        super().__init__(device)
        self._report_fn, self._get_checkpoint_fn, self._checkpoint_cls = tune.report, tune.get_checkpoint, tune.Checkpoint


def train_fn_per_worker(loop_config: dict) -> None:
    """The Ray Train worker function: plain ``train`` with a Ray environment."""
    torch.set_num_threads(loop_config["threads"])
    # Ray Train logs every report at INFO through a root-level logger; keep warnings and errors
    logging.getLogger().setLevel(logging.WARNING)
    config = TrainConfig.from_dict(loop_config["config"])
    env = RayTrainEnv(loop_config.get("inject_failure"))
    env.finish(train(config, env))


def trainer_for(config: TrainConfig, storage_path: str | os.PathLike, name: str, callbacks=(), inject_failure: dict | None = None):
    """A ``TorchTrainer`` for ``config`` (``config.workers`` workers)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    resources = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker > 0:
        resources["GPU"] = config.gpus_per_worker
    return TorchTrainer(
        train_fn_per_worker,
        train_loop_config={"config": config.to_dict(), "threads": max(1, int(config.cpus_per_worker)), "inject_failure": inject_failure},
        scaling_config=ray.train.ScalingConfig(num_workers=config.workers, use_gpu=config.gpus_per_worker > 0, resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(Path(storage_path).resolve()),
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),  # resuming reads only the latest
            callbacks=list(callbacks),
            # Ray Train's INFO lines (every report and checkpoint) would bury the progress lines
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )


def read_result(config: TrainConfig, checkpoint) -> RunResult:
    """The ``RunResult`` stored in a finished run's last checkpoint."""
    with checkpoint.as_directory() as directory:
        payload = torch.load(Path(directory) / RESULT_FILE, map_location="cpu", weights_only=False)
    return RunResult(config, **payload)


def train_distributed(config: TrainConfig, out_dir=None, log=None, *, resource_timeout_s: float = DEFAULT_RESOURCE_TIMEOUT_S,
                      inject_failure: dict | None = None) -> RunResult:
    """Run ``config`` on ``config.workers`` Ray Train workers and return its results.

    Checkpoints live under ``out_dir/ray`` (a temporary directory without ``out_dir``); running the
    same config with the same ``out_dir`` again resumes.  Workers that the Ray in use cannot hold
    raise ``InsufficientResources`` (see ``ray_session.check_capacity``) instead of waiting forever.
    ``inject_failure`` (``{"after_epoch", "rank", "marker"}``) kills that worker once, for
    fault-tolerance tests.
    """
    demand = run_demand(config.workers, config.cpus_per_worker, config.gpus_per_worker)
    check_before_start(demand)
    ensure_ray()
    check_capacity(demand, timeout_s=resource_timeout_s, log=log)
    storage = Path(out_dir) / "ray" if out_dir is not None else Path(tempfile.mkdtemp(prefix="dpsm_ray_"))
    result = trainer_for(config, storage, f"train-{config.config_hash()}", inject_failure=inject_failure).fit()
    return read_result(config, result.checkpoint)
