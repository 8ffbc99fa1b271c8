"""A method defined here, outside the package, registered through ``register_method`` and run in a
one-trial sweep on digits end to end: its search and final rows in the Parquet files and its row in
the report (docs/extending.md walks through the same steps)."""

import sys

import pandas as pd
import pytest
import torch

from dpsm_ray.cards import MethodCard, register_method, unregister_method
from dpsm_ray.objectives.base import Objective
from dpsm_ray.sweep.driver import run_sweep
from dpsm_ray.sweep.spec import SweepSpec
from dpsm_ray.config import TrainConfig

pytestmark = pytest.mark.ray


class ConfidentCE(Objective):
    """CE plus lambda times the mean top-class probability of B2: a made-up method."""

    def __call__(self, logits1, labels1, logits2, labels2):
        ce = torch.nn.functional.cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        return self._output(ce, logits2.softmax(dim=1).amax(dim=1).mean())


@pytest.fixture
def confident_ce():
    import ray.cloudpickle

    # a test module is not importable in Ray's worker processes: its class travels by value (a
    # method in an installed package travels by reference, one in a script's __main__ by value)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    card = register_method(MethodCard("confident_ce", "Confident CE", ConfidentCE, fields=("conformal_weight",), knobs=("conformal_weight", "lr")))
    yield card
    unregister_method(card.name)
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_a_method_registered_outside_the_package_runs_a_one_trial_sweep_end_to_end(ray_session, tmp_path, confident_ce):
    base = TrainConfig(dataset="digits", init="scratch", epochs=2, batch_size=64, val_splits=2, eval_splits=2, workers=0)
    spec = SweepSpec(name="outside", base=base, methods=("confident_ce",), trials=1, final_seeds=1, coverage_slack=0.2, seed=0)
    lines = []
    run_sweep(spec, tmp_path, log=lines.append)
    trials = pd.read_parquet(tmp_path / "trials.parquet")
    assert sorted(zip(trials.stage, trials.method)) == [("final", "confident_ce"), ("search", "confident_ce")]
    assert (trials.status == "ok").all()
    # its option is spelled out; the options it does not read are null
    assert trials.conformal_weight.notna().all() and trials.quantile_lr.isna().all() and trials.sigmoid_temperature.isna().all()
    evals = pd.read_parquet(tmp_path / "evals.parquet")
    assert set(evals.method) == {"confident_ce"} and len(evals) > 0
    report = (tmp_path / "report.md").read_text()
    assert any(line.startswith("| Confident CE | ") and "±" in line for line in report.splitlines()), report
