"""A dataset, a model and a score defined here, outside the package, registered through their
cards and run in a one-trial sweep end to end: Parquet rows, the report's rows, and a predictor
that calibrated the score and gives its sets (docs/extending.md walks through the same steps)."""

import sys

import pandas as pd
import pytest
import torch

from dpsm_ray.cards import DatasetCard, ModelCard, ScoreCard, register_dataset, register_model, register_score, unregister
from dpsm_ray.sweep.driver import run_sweep
from dpsm_ray.sweep.spec import SweepSpec
from dpsm_ray.config import TrainConfig

pytestmark = pytest.mark.ray

BLOB_SIZES = {"train": 600, "val": 200, "cal": 200, "test": 200}


def load_blobs(spec, *, seed, **_):
    """Four Gaussian classes in 6 dimensions, drawn from the run's seed."""
    from dpsm_ray.data import from_tensors

    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(sum(BLOB_SIZES.values())) % 4
    centres = torch.randn(4, 6, generator=generator)
    inputs = centres[labels] + 1.2 * torch.randn(len(labels), 6, generator=generator)
    return from_tensors(spec, inputs, labels, BLOB_SIZES, seed, class_names=("north", "east", "south", "west"))


def linear(input_shape, num_classes, pretrained_path=None):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))


def top_gap(probs, u=None, *, scale):
    """The top class's probability minus the label's (0 for the top class), times ``scale``."""
    return scale * (probs.amax(dim=1, keepdim=True) - probs)


@pytest.fixture
def outside_cards():
    import ray.cloudpickle

    # a test module is not importable in Ray's worker processes: its functions travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    register_model(ModelCard("linear", "a linear layer", linear))
    register_dataset(DatasetCard("blobs", "four Gaussian blobs", lambda spec: dict(BLOB_SIZES), load_blobs, "linear"))
    register_score(ScoreCard("top_gap", "the top probability's lead", top_gap, parameters={"scale": 1.0}))
    yield
    for kind, name in (("dataset", "blobs"), ("model", "linear"), ("score", "top_gap")):
        unregister(kind, name)
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_a_dataset_model_and_score_registered_outside_the_package_run_a_sweep_end_to_end(ray_session, tmp_path, outside_cards):
    from dpsm_ray import Predictor
    from dpsm_ray.cards import load_splits

    # from a base model: its training, as the predictors' writing, runs in a Ray task that must register the outside cards
    base = TrainConfig(dataset="blobs", init="base", base_epochs=1, epochs=2, batch_size=64, val_splits=2, eval_splits=2, workers=0,
                       eval_scores=("hps", "top_gap"))
    spec = SweepSpec(name="outside", base=base, methods=("ce",), trials=1, final_seeds=1, coverage_slack=0.2, seed=0)
    run_sweep(spec, tmp_path, log=lambda line: None)
    trials = pd.read_parquet(tmp_path / "trials.parquet")
    assert (trials.status == "ok").all() and set(trials.dataset) == {"blobs"} and set(trials.model) == {"linear"}
    evals = pd.read_parquet(tmp_path / "evals.parquet")
    assert set(evals.score) == {"hps", "top_gap"} and set(evals.calibration) == {"marginal"} and evals.coverage.between(0, 1).all()
    report = (tmp_path / "report.md").read_text()
    assert "top_gap" in report.lower(), report

    # the exported predictor calibrated the outside score (with its parameter) and predicts with it
    from dpsm_ray.storage.layout import read_index

    predictor = Predictor.load(tmp_path / "predictors" / read_index(tmp_path)["chosen"]["ce"])
    assert predictor.info["scores"]["top_gap"]["scale"] == 1.0 and predictor.info["class_names"] == ["north", "east", "south", "west"]
    data = load_splits("blobs", seed=0)
    x = data.test.source.inputs[data.test.ids[:20]]
    sets = predictor.predict_sets(x, score="top_gap")
    probs = predictor.predict_proba(x)
    expected = (probs.amax(dim=1, keepdim=True) - probs) <= predictor.threshold("top_gap")
    assert torch.equal(sets.mask, expected)
