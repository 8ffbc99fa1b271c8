"""The dataset, model and score cards: every place that offers a choice offers the cards' names,
and registering a card from outside the package is checked, and reaches those places."""

import argparse

import pytest
import torch

from dpsm_ray import cards
from dpsm_ray.cards import DatasetCard, ModelCard, ScoreCard, register_dataset, register_model, register_score, unregister


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_every_place_that_offers_a_choice_offers_the_cards():
    from dpsm_ray.cli import build_parser
    from dpsm_ray.conformal import Resplits, evaluate
    from dpsm_ray.sweep.cli import build_parser as sweep_parser
    from dpsm_ray.config import ConfigError, TrainConfig, field_help

    names = {"dataset": cards.dataset_names(), "model": cards.model_names(), "score": cards.score_names()}
    assert names["dataset"] == ("digits", "synthetic", "glyphs", "fonts", "fonts_transfer", "fashion_mnist", "cifar100", "caltech101", "inaturalist", "inaturalist2018",
                                "folder", "table")
    assert names["score"] == ("hps", "aps", "raps", "saps", "topk", "margin")  # the report's order
    parser = build_parser()
    train = subparser(parser, "train")
    for name in names["dataset"]:
        assert name in option(train, "--dataset").help
    for name in names["model"]:
        assert name in option(train, "--model").help
    assert tuple(option(subparser(parser, "predict"), "--score").choices) == names["score"]
    assert set(TrainConfig().eval_scores) <= set(names["score"]) and all(name in field_help("eval_scores") for name in names["score"])
    assert cards.paper_score_names() == ("hps", "aps", "raps")  # the paper's, in the cards' order
    # the sweep scripts' options: the same help texts; the GPU packing names every model
    sweep = sweep_parser("digits", "a sweep", {"trials": 2, "final_seeds": 1, "config": {"dataset": "digits"}})
    assert option(sweep, "--dataset").help.startswith(field_help("dataset"))
    assert all(name in option(sweep, "--trials-per-gpu").help for name in names["model"])
    # validation names the cards
    for field, value, listed in (("dataset", "mnist", "dataset"), ("model", "vgg", "model"), ("eval_scores", ("lac",), "score")):
        with pytest.raises(ConfigError) as error:
            TrainConfig(**{field: value})
        assert all(name in str(error.value) for name in names[listed]), error.value
    # evaluation: every score, in the cards' order
    probs = torch.softmax(torch.randn(40, 3, generator=torch.Generator().manual_seed(0)), dim=1)
    rows = evaluate(probs, torch.arange(40) % 3, 0.2, Resplits(cards.score_functions(), splits=1), wsc_directions=1)
    assert tuple(dict.fromkeys(row["score"] for row in rows)) == names["score"]


def test_cards_registered_outside_appear_in_the_choices_and_can_be_removed():
    from dpsm_ray.cli import build_parser
    from dpsm_ray.config import TrainConfig, field_help

    register_model(ModelCard("tiny", "a linear layer", lambda shape, k, path=None: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, k))))
    register_dataset(DatasetCard("tiny_digits", "digits again", lambda spec: cards.split_sizes("digits"), lambda spec, **kw: None, "tiny"))
    register_score(ScoreCard("one_minus_sqrt", "1 - sqrt(p_y)", lambda probs, u=None: 1 - probs.sqrt()))
    try:
        assert "tiny_digits" in field_help("dataset") and "tiny_digits: tiny" in field_help("model")
        assert "one_minus_sqrt" in option(subparser(build_parser(), "predict"), "--score").choices
        TrainConfig(dataset="tiny_digits", eval_scores=("hps", "one_minus_sqrt"))
        assert cards.default_model("tiny_digits") == "tiny" and cards.outside_cards()[0].name == "tiny"
    finally:
        for kind, name in (("dataset", "tiny_digits"), ("model", "tiny"), ("score", "one_minus_sqrt")):
            unregister(kind, name)
    assert "tiny_digits" not in cards.dataset_names() and cards.outside_cards() == ()


def test_bad_cards_are_refused_in_one_line_naming_what_is_wrong():
    with pytest.raises(ValueError, match="dataset name must be an identifier"):
        register_dataset(DatasetCard("my data", "x", dict, dict, "mlp"))
    with pytest.raises(ValueError, match="default_model must be a registered model .*; got 'vit'"):
        register_dataset(DatasetCard("mine", "x", dict, dict, "vit"))
    with pytest.raises(ValueError, match="model mine: inputs must be one of any, image, rgb; got 'text'"):
        register_model(ModelCard("mine", "x", dict, inputs="text"))
    with pytest.raises(ValueError, match="trials_per_gpu must be an integer >= 1"):
        register_model(ModelCard("mine", "x", dict, trials_per_gpu=0))
    with pytest.raises(ValueError, match="score 'hps' is built in"):
        register_score(ScoreCard("hps", "mine", dict), replace=True)
    with pytest.raises(ValueError, match="model 'lenet' is built in"):
        unregister("model", "lenet")
    register_score(ScoreCard("twice", "x", lambda probs, u=None: probs))
    try:
        with pytest.raises(ValueError, match="score 'twice' is registered already"):
            register_score(ScoreCard("twice", "another", lambda probs, u=None: probs))
    finally:
        unregister("score", "twice")


def test_a_model_from_outside_must_return_an_nn_module_with_one_logit_per_class():
    from dpsm_ray.cards import build_model

    def build(returns):
        register_model(ModelCard("probe", "x", lambda shape, k, path=None: returns(k)), replace=True)
        try:
            return build_model("probe", 10, input_shape=(64,))
        finally:
            unregister("model", "probe")

    assert isinstance(build(lambda k: torch.nn.Linear(64, k)), torch.nn.Linear)
    with pytest.raises(TypeError, match="model probe: its card's build returned dict, not a torch.nn.Module"):
        build(lambda k: {})
    with pytest.raises(ValueError, match=r"model probe: must return logits \[n, 10\] for inputs \[n, 64\]; got \[2, 7\] for n = 2"):
        build(lambda k: torch.nn.Linear(64, 7))
    with pytest.raises(ValueError, match=r"model probe: a batch of inputs \[2, 64\] fails in its forward: RuntimeError"):
        build(lambda k: torch.nn.Linear(32, k))


def test_a_score_is_computed_by_its_card_with_its_own_parameters():
    from dpsm_ray.cards import score_matrix

    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    # RAPS = APS + lambda max(0, rank - k_reg), by hand at U = 1: ranks of row 0 are 1, 2, 3
    raps = score_matrix(probs, "raps", parameters={"lambda": 0.5, "k_reg": 1})
    assert raps[0].tolist() == pytest.approx([0.5, 0.8 + 0.5, 1.0 + 1.0])
    assert torch.equal(score_matrix(probs, "raps", parameters={"lambda": 0.0}), score_matrix(probs, "aps"))
    with pytest.raises(ValueError, match="score hps has no parameter k_reg; it has none"):
        score_matrix(probs, "hps", parameters={"k_reg": 2})
