"""A method defined here, outside the package, with an option of its own (``MethodOption``),
registered through ``register_method``: its option reaches ``dpsm-ray train``'s command line, a
sweep's config file, the sweep's Ray trials and its predictors, and it runs a one-trial sweep on
digits end to end -- its search and final rows in the Parquet files and its row in the report
(docs/extending.md walks through the same steps)."""

import dataclasses
import json
import sys

import pandas as pd
import pytest
import torch

from dpsm_ray.cards import MethodCard, MethodOption, register_method, unregister_method
from dpsm_ray.cli import main as dpsm_ray
from dpsm_ray.config import ConfigError, TrainConfig
from dpsm_ray.objectives.base import Objective
from dpsm_ray.sweep.cli import main as sweep

pytestmark = pytest.mark.ray
BUILT = []  # the powers ConfidentCE was built with in this process


class ConfidentCE(Objective):
    """CE plus lambda times the mean top-class probability of B2 to a power: a made-up method."""

    def __init__(self, *, confidence_power: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.power = confidence_power
        BUILT.append(confidence_power)

    def __call__(self, logits1, labels1, logits2, labels2):
        ce = torch.nn.functional.cross_entropy(torch.cat([logits1, logits2]), torch.cat([labels1, labels2]))
        return self.output(ce, (logits2.softmax(dim=1).amax(dim=1) ** self.power).mean())


POWER = MethodOption("confidence_power", 1.0, "Confident CE's power of the top-class probability, > 0", "must be > 0",
                     lambda value: value > 0, sweep=True)


@pytest.fixture
def confident_ce():
    import ray.cloudpickle

    # a test module is not importable in Ray's worker processes: its class travels by value (a
    # method in an installed package travels by reference, one in a script's __main__ by value)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    card = register_method(MethodCard("confident_ce", "Confident CE", ConfidentCE, fields=("conformal_weight",),
                                      knobs=("conformal_weight", "lr"), options=(POWER,)))
    yield card
    unregister_method(card.name)
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_an_outside_option_is_a_config_value_checked_and_hashed_for_its_method_only(confident_ce):
    config = TrainConfig(method="confident_ce", confidence_power=2.0)
    assert config.confidence_power == 2.0 and TrainConfig(method="confident_ce").confidence_power == 1.0
    assert TrainConfig.from_dict(config.to_dict()) == config and config.to_dict()["confidence_power"] == 2.0
    assert config.config_hash() != TrainConfig(method="confident_ce").config_hash()
    # another method does not read it: its hash and its recorded settings stay as they were
    assert TrainConfig(method="dpsm", confidence_power=2.0).config_hash() == TrainConfig(method="dpsm").config_hash()
    assert "confidence_power" not in TrainConfig(method="dpsm").to_dict()
    with pytest.raises(ConfigError, match="confidence_power=-1.0 is invalid: must be > 0"):
        TrainConfig(method="confident_ce", confidence_power=-1.0)
    with pytest.raises(ValueError, match="new identifiers"):  # an option may not take a field's or a built-in option's name
        register_method(MethodCard("other", "Other", ConfidentCE, options=(MethodOption("sigmoid_temperature", 2.0, "T"),)))
    with pytest.raises(ValueError, match="new identifiers"):  # nor another card's
        register_method(MethodCard("other", "Other", ConfidentCE, options=(MethodOption("confidence_power", 2.0, "P"),)))
    # the same card again -- as a trial's process registers it, unpickled, its check a new function -- replaces itself
    again = dataclasses.replace(confident_ce, options=(dataclasses.replace(POWER, check=lambda value: value > 0),))
    assert register_method(again, replace=True) is again and TrainConfig(method="confident_ce", confidence_power=3.0).confidence_power == 3.0


def test_an_outside_option_reaches_the_train_command_line(confident_ce, tmp_path, capsys):
    BUILT.clear()
    out = tmp_path / "run"
    assert dpsm_ray(["train", "--dataset", "digits", "--method", "confident_ce", "--confidence-power", "3", "--epochs", "1",
                     "--eval-splits", "1", "--val-splits", "1", "--out", str(out)]) == 0
    assert BUILT == [3.0] and json.loads((out / "config.json").read_text())["confidence_power"] == 3.0
    with pytest.raises(SystemExit):
        dpsm_ray(["train", "--help"])
    assert "--confidence-power" in capsys.readouterr().out


def test_a_method_registered_outside_the_package_runs_a_one_trial_sweep_from_a_config_file(ray_session, tmp_path, confident_ce):
    config = tmp_path / "sweep.yaml"
    config.write_text("dataset: digits\nmethods: confident_ce\ntrials: 1\nfinal_seeds: 1\ncoverage_slack: 0.2\nepochs: 2\n"
                      "batch_size: 64\nworkers: 0\nconfidence_power: 2.5\nbase:\n  val_splits: 2\n  eval_splits: 2\n")
    results = tmp_path / "results"
    assert sweep("digits", "outside", {"trials": 4, "final_seeds": 2, "config": {"dataset": "digits"}},
                 ["--config", str(config), "--results-dir", str(results)]) == 0
    trials = pd.read_parquet(results / "trials.parquet")
    assert sorted(zip(trials.stage, trials.method)) == [("final", "confident_ce"), ("search", "confident_ce")]
    assert (trials.status == "ok").all()
    # its options reach the Ray trials: the one it was given, and the built-in one it reads; those it does not read are null
    assert all(json.loads(text)["confidence_power"] == 2.5 for text in trials.config_json)
    assert trials.conformal_weight.notna().all() and trials.quantile_lr.isna().all() and trials.sigmoid_temperature.isna().all()
    evals = pd.read_parquet(results / "evals.parquet")
    assert set(evals.method) == {"confident_ce"} and len(evals) > 0
    report = (results / "report.md").read_text()
    assert any(line.startswith("| Confident CE | ") and "±" in line for line in report.splitlines()), report
    # and its predictor, which records the settings it was trained with
    (info,) = [json.loads(path.read_text())["payload"] for path in (results / "predictors").glob("*/predictor.json")]
    assert info["method"] == "confident_ce" and info["training_config"]["confidence_power"] == 2.5
