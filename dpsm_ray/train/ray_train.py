"""Ray glue: the same loop as a Tune trial in its own process, or on ``TorchTrainer`` workers (DDP;
nccl on GPUs, gloo on CPU).

A run under Ray keeps everything it writes in one *run directory*, which must be on storage that
every node sees (a sweep's results directory; ``--out``): ``checkpoint.pt`` (rank 0, after every
epoch or ``checkpoint_every``), ``epochs.json`` (every epoch row so far) and, when the run has
finished, ``result.json`` (the final evaluation rows).  A run started again with the same directory
-- a Tune retry after a lost node, Ray Train's restart of a failed worker group, a resumed sweep --
continues from the checkpoint.  Reports to Ray carry metrics only: Tune and Train keep no state
that a resume would need.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from dpsm_ray.files import read_checked_json, write_checked_json
from dpsm_ray.storage.layout import CHECKPOINT_FILE, EPOCHS_FILE, RESULT_FILE
from dpsm_ray.config import TrainConfig
from dpsm_ray.train.env import LocalEnv, ProcessGroupEnv, load_checkpoint, pick_device, save_checkpoint
from dpsm_ray.train.loop import RunResult, train
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S, check_before_start, check_capacity, ensure_ray, run_demand

RAY_TRAIN_DIR = "ray_train"  # Ray Train's own state, beside the run's files
# Marks the last report (the results).  Not "done": Tune reads "done" as "stop this trial" and
# would kill the trial driver while its Train run is still shutting down (leaking its placement group).
FINISHED = "run_finished"
# Marks the report a resumed run sends of its last finished epoch before training on, so that a
# scheduler judges it where an uninterrupted run was judged (see RunDirReporting.load_state).
RESUMED = "resumed"
# Marks the last report of a trial group's member that failed (dpsm_ray.train.group): its error's
# line; the group goes on with its other members.
MEMBER_FAILED = "member_failed"


class GpuUnavailable(RuntimeError):
    """A process that holds a share of a GPU but cannot see a CUDA device."""


def assigned_gpus() -> list[str]:
    """The GPU ids Ray gave this process (empty for a CPU-only trial or worker)."""
    import ray

    return [str(gpu) for gpu in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def trial_device(name: str) -> torch.device:
    """The device of a process Ray started for a trial or a Train worker, from ``--device``.

    With a GPU share, ``auto`` and ``cuda`` mean the GPU Ray assigned (its position in
    ``CUDA_VISIBLE_DEVICES``); when torch sees no CUDA device the process stops with
    ``GpuUnavailable`` naming the node and ``CUDA_VISIBLE_DEVICES`` instead of training on the CPU,
    30-100x slower and without a word.  ``cpu`` trains on the CPU whatever the share: how
    GPU-shaped resources run on CPU machines, on purpose.  Without a share, ``auto`` is the CPU
    (Ray leaves CUDA_VISIBLE_DEVICES alone in a process without GPUs: it sees every GPU of its node,
    which belong to other trials)."""
    gpus = assigned_gpus()
    if not gpus and name == "auto":
        return torch.device("cpu")  # a GPU Ray did not give this process is another trial's
    if name == "cpu" or not gpus:
        return pick_device(name)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        import ray

        raise GpuUnavailable(
            f"node {ray.util.get_node_ip_address()}: this trial holds GPU {','.join(gpus)} (CUDA_VISIBLE_DEVICES={visible!r}) but torch "
            "sees no CUDA device (driver, CUDA build of torch, or container GPU access); it stops rather than train on the CPU "
            "(--device cpu runs on the CPU on purpose)"
        )
    if name.startswith("cuda:"):
        return torch.device(name)
    ids = visible.split(",") if visible else []
    return torch.device("cuda", ids.index(gpus[0]) if gpus[0] in ids else 0)


def placement(device: torch.device) -> dict:
    """What a trial reports of where it trained (trials.parquet's ``device`` and ``gpu_ids``)."""
    return {"device": str(device), "gpu_ids": ",".join(assigned_gpus()) or None}


class RunDirReporting:
    """Checkpoints, epoch rows and results in ``run_dir`` (rank 0 writes), and each epoch's
    metrics (plus ``extra``) reported to a Ray session.  Every rank reports equally often: Ray
    Train's ``report`` is a barrier."""

    _report_fn: Callable  # ray.train.report or ray.tune.report
    run_dir: Path
    extra: dict

    def load_state(self) -> dict | None:
        """The checkpoint, after reporting its last epoch again (marked ``RESUMED``): a trial
        killed right after a scheduler stopped it is then stopped again before it trains on."""
        state = super().load_state()
        if state is not None and state["epochs"]:
            self._report_fn({**state["epochs"][-1], **self.extra, RESUMED: True})
        return state

    def report(self, row: dict, checkpoint: dict | None, epochs: list[dict] | None = None) -> None:
        super().report(row, checkpoint, epochs)
        if self.collective.rank == 0 and epochs is not None:
            write_checked_json(self.run_dir / EPOCHS_FILE, epochs)
        self._report_fn({**row, **self.extra})

    def finish(self, result: RunResult) -> None:
        """Write the results, then one last report that says so."""
        if self.collective.rank == 0:
            if not result.epochs:  # a base model evaluated as it is (0 epochs): its weights, for read_result
                save_checkpoint(self.run_dir / CHECKPOINT_FILE, {"epoch": -1, "model": result.model_state, "epochs": []})
            payload = {
                field.name: getattr(result, field.name)
                for field in dataclasses.fields(result)
                if field.name not in ("config", "model_state", "epochs")
            }
            write_checked_json(self.run_dir / RESULT_FILE, payload)
        metrics = {"epoch": len(result.epochs), FINISHED: True, **self.extra}
        if result.epochs:
            metrics.update({k: v for k, v in result.epochs[-1].items() if k != "epoch"})
        self._report_fn(metrics)

    def fail(self, message: str) -> None:
        """One last report, of a trial group's member that failed with ``message``: what Tune's
        error says of a trial that fails alone."""
        self._report_fn({**self.extra, MEMBER_FAILED: message})


class RayTrainEnv(RunDirReporting, ProcessGroupEnv):
    """A Ray Train worker (DDP over the worker group)."""

    def __init__(self, device: torch.device, run_dir: str | os.PathLike, extra: dict | None = None) -> None:
        import ray.train

        super().__init__(device, Path(run_dir) / CHECKPOINT_FILE)
        self.run_dir = Path(run_dir)
        self.extra = {**(extra or {}), **placement(device)}
        self._report_fn = ray.train.report


class TuneTrialEnv(RunDirReporting, LocalEnv):
    """A Tune trial that trains in its own process, without a Ray Train worker group."""

    def __init__(self, device: torch.device, run_dir: str | os.PathLike, extra: dict | None = None) -> None:
        from ray import tune

        super().__init__(device, Path(run_dir) / CHECKPOINT_FILE)
        self.run_dir, self.extra = Path(run_dir), {**(extra or {}), **placement(device)}
        self._report_fn = tune.report


def train_fn_per_worker(loop_config: dict) -> None:
    """The Ray Train worker function: plain ``train`` with a Ray environment."""
    torch.set_num_threads(loop_config["threads"])
    # Ray Train logs every report at INFO through a root-level logger; keep warnings and errors
    logging.getLogger().setLevel(logging.WARNING)
    config = TrainConfig.from_dict(loop_config["config"])
    env = RayTrainEnv(trial_device(config.device), loop_config["run_dir"], loop_config.get("extra"))
    env.finish(train(config, env))


def trainer_for(config: TrainConfig, run_dir: str | os.PathLike, callbacks=(), extra: dict | None = None, worker_fn=train_fn_per_worker):
    """A ``TorchTrainer`` of ``config.workers`` workers writing into ``run_dir``, each running
    ``worker_fn(loop_config)`` (``train_fn_per_worker``; a test may wrap it)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = {"CPU": config.cpus_per_worker}
    if config.gpus_per_worker > 0:
        resources["GPU"] = config.gpus_per_worker
    run_dir = Path(run_dir).resolve()
    return TorchTrainer(
        worker_fn,
        train_loop_config={
            "config": config.to_dict(),
            "threads": max(1, int(config.cpus_per_worker)),
            "run_dir": str(run_dir),
            "extra": extra,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.workers, use_gpu=config.gpus_per_worker > 0, resources_per_worker=resources
        ),
        # nccl when the workers hold GPUs (Ray's default), gloo when they train on the CPU on purpose
        torch_config=TorchConfig(backend="gloo" if config.device == "cpu" else None),
        run_config=ray.train.RunConfig(
            name=RAY_TRAIN_DIR,
            storage_path=str(run_dir),
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            callbacks=list(callbacks),
            # Ray Train's INFO lines (every report) would bury the progress lines
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )


def _read_result(config: TrainConfig, run_dir: str | os.PathLike) -> RunResult:
    """The ``RunResult`` of a finished run from its directory (results and final checkpoint)."""
    run_dir = Path(run_dir)
    payload = read_checked_json(run_dir / RESULT_FILE)
    state = load_checkpoint(run_dir / CHECKPOINT_FILE)
    return RunResult(config, epochs=state["epochs"], model_state=state["model"], **payload)


def train_distributed(config: TrainConfig, out_dir=None, log=None, *, resource_timeout_s: float = DEFAULT_RESOURCE_TIMEOUT_S,
                      worker_fn=train_fn_per_worker) -> RunResult:
    """Run ``config`` on ``config.workers`` Ray Train workers and return its results.

    ``out_dir`` is the run directory (a temporary one without it; with workers on other nodes it
    must be on shared storage); running the same config with the same ``out_dir`` again resumes.
    Workers that the Ray in use cannot hold raise ``InsufficientResources`` (see
    ``ray_session.check_capacity``) instead of waiting forever.  ``worker_fn``: what each worker
    runs (``trainer_for``).
    """
    demand = run_demand(config.workers, config.cpus_per_worker, config.gpus_per_worker)
    check_before_start(demand)
    ensure_ray()
    check_capacity(demand, timeout_s=resource_timeout_s, log=log)
    run_dir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="dpsm_ray_"))
    trainer_for(config, run_dir, worker_fn=worker_fn).fit()
    return _read_result(config, run_dir)
