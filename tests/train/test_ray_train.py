"""The loop on Ray Train workers: the same results as in this process, and fault tolerance."""

import pytest
import torch

from dpsm_ray.train import LocalEnv, TrainConfig, run_training, train
from dpsm_ray.train.ray_train import train_distributed

pytestmark = pytest.mark.ray

# Settings where float32 summation-order differences between 1 and 2 workers do not grow (see
# test_distributed.py); the maths itself is checked exactly there.
BASE = dict(
    dataset="digits", model="mlp", method="dpsm", epochs=3, batch_size=64, eval_splits=2, val_splits=2,
    conformal_weight=0.1, lr=0.01, quantile_lr=0.2, sort_temperature=0.3, sigmoid_temperature=0.5,
)
COMPARED = ("upper_loss", "ce_loss", "conformal_loss", "lower_loss", "q", "q_dataset", "q_error", "val_coverage", "val_set_size")


@pytest.fixture(scope="module")
def reference():
    return train(TrainConfig(**BASE), LocalEnv(torch.device("cpu"), log=lambda line: None))


def assert_same_run(expected, actual):
    assert len(actual.epochs) == len(expected.epochs)
    for one, two in zip(expected.epochs, actual.epochs):
        for column in COMPARED:
            assert two[column] == pytest.approx(one[column], abs=1e-5), column
    for name, tensor in expected.model_state.items():
        assert torch.allclose(tensor, actual.model_state[name], atol=1e-5), name
    assert [r["coverage"] for r in actual.evals] == pytest.approx([r["coverage"] for r in expected.evals])


def test_two_ray_train_workers_match_one_process(ray_session, reference, tmp_path):
    config = TrainConfig(**BASE, workers=2, cpus_per_worker=1, debug_sync_checks=True)
    assert_same_run(reference, run_training(config, tmp_path / "run"))


def dying_worker(marker: str, after_epoch: int, rank: int):
    """The workers' function, with the worker of ``rank`` killed (SIGKILL) once, right after it
    reported ``after_epoch``: ``marker`` says it happened."""

    def worker(loop_config: dict) -> None:
        import os
        import signal
        from pathlib import Path

        from dpsm_ray.train import ray_train

        report = ray_train.RunDirReporting.report

        def report_then_die(self, row, checkpoint, epochs=None):
            report(self, row, checkpoint, epochs)
            if row["epoch"] == after_epoch and self.collective.rank == rank and not Path(marker).exists():
                Path(marker).write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)

        ray_train.RunDirReporting.report = report_then_die  # in this worker's process only
        ray_train.train_fn_per_worker(loop_config)

    return worker


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(ray_session, reference, tmp_path):
    import sys

    import ray.cloudpickle

    config = TrainConfig(**BASE, workers=2, cpus_per_worker=1, max_failures=1)
    marker = tmp_path / "killed-once"
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # a test module is not importable in Ray's workers
    try:
        result = train_distributed(config, tmp_path / "run", worker_fn=dying_worker(str(marker), after_epoch=2, rank=1))
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert marker.exists(), "the failure was not injected"
    # resumed after epoch 2: DPSM's q and the model continue from the checkpoint, so the run
    # ends exactly where the uninterrupted one does
    assert_same_run(reference, result)
