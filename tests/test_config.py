import pytest
import torch

from dpsm_ray.cards import METHODS
from dpsm_ray.config import ConfigError, TrainConfig


@pytest.mark.parametrize(
    "changes,field,fragment",
    [
        ({"alpha": 0.0}, "alpha", "(0, 1)"),
        ({"alpha": 1.2}, "alpha", "(0, 1)"),
        ({"conformal_weight": -0.1}, "conformal_weight", ">= 0"),
        ({"lr": 0.0}, "lr", "> 0"),
        ({"quantile_lr": -1.0}, "quantile_lr", "> 0"),
        ({"sigmoid_temperature": -1.0}, "sigmoid_temperature", "> 0"),
        ({"method": "thr"}, "method", "ce, conftr, conftr_published, confts, cut, dpsm, rwce, vr_conftr, or base"),
        ({"dataset": "mnist"}, "dataset", "digits, synthetic"),
        ({"model": "vgg"}, "model", "must be auto or one of mlp, mlp_bn, cnn"),
        ({"batch_size": 2000}, "batch_size", "at most 1000"),
        ({"batch_size": 63}, "batch_size", "even"),
        ({"milestones": (25, 3)}, "milestones", "increasing"),
        ({"eval_scores": ("thr",)}, "eval_scores", "hps, aps, raps, saps, topk, margin"),
        ({"eval_calibrations": ("mondrian",)}, "eval_calibrations", "marginal, class"),
        ({"eval_calibrations": ()}, "eval_calibrations", "some of marginal, class, cluster, rc3p, each once"),
        ({"eval_calibrations": ("class", "class")}, "eval_calibrations", "some of marginal, class, cluster, rc3p, each once"),
        ({"train_subset": 5000}, "train_subset", "at most"),
        ({"alpha": float("nan")}, "alpha", "finite"),
        ({"q_init": "median"}, "q_init", "dataset, zero, random"),
        ({"conftr_split": "thirds"}, "conftr_split", "halves, batch"),
        ({"cut_score": "raps"}, "cut_score", "hps, aps"),
        ({"lr_schedule": "cosine"}, "lr_schedule", "step, exp"),
    ],
)
def test_bad_values_name_the_field_value_and_range(changes, field, fragment):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**changes)
    assert error.value.field == field
    assert fragment in str(error.value) and repr(changes[field]) in str(error.value)


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match="lamda"):
        TrainConfig.from_dict({"lamda": 0.1})


def test_config_hash_ignores_operational_fields_only():
    base = TrainConfig()
    assert base.config_hash() == TrainConfig(device="cpu", data_workers=1, checkpoint_every=3).config_hash()
    assert base.config_hash() != TrainConfig(seed=1).config_hash()
    assert base.config_hash() != TrainConfig(conformal_weight=0.25).config_hash()


def test_an_option_only_another_method_reads_leaves_the_hash_alone():
    for methods, option, value in [(("dpsm",), "q_init", "random"), (("dpsm",), "quantile_lr", 0.3), (("conftr",), "conftr_split", "halves"),
                                   (("cut",), "cut_score", "aps"), (("dpsm",), "dpsm_split", "batch"), (("cut", "dpsm"), "ce_batch", "half"),
                                   (("conftr_published",), "size_target", 1.0), (("conftr_published",), "ce_weight", 0.5),
                                   (("conftr", "conftr_published", "dpsm", "vr_conftr"), "sigmoid_temperature", 0.3),
                                   (("conftr", "conftr_published", "cut", "dpsm", "vr_conftr"), "conformal_weight", 2.0)]:
        for method in methods:
            assert TrainConfig(method=method, **{option: value}).config_hash() != TrainConfig(method=method).config_hash(), option
        for other in set(METHODS) - set(methods):
            assert TrainConfig(method=other, **{option: value}).config_hash() == TrainConfig(method=other).config_hash(), (option, other)
    assert TrainConfig(lr_schedule="exp").config_hash() != TrainConfig().config_hash()  # every method's


def test_scores_and_calibrations_added_since_leave_every_earlier_run_its_hash():
    # the hashes of these configs before SAPS, top-k, margin and class-conditional evaluation existed (measured on that
    # release): the default still evaluates the paper's three scores, marginally, and a field at its default is left out
    assert TrainConfig().eval_scores == ("hps", "aps", "raps") and TrainConfig().eval_calibrations == ("marginal",)
    assert TrainConfig().config_hash() == "3055846e23fa1821"
    assert TrainConfig(method="ce", dataset="fashion_mnist").config_hash() == "a0de0d7ab2967ee9"
    both = TrainConfig(eval_calibrations=("marginal", "class"))
    assert both.config_hash() != TrainConfig().config_hash() and TrainConfig.from_dict(both.to_dict()) == both
    # at its default it is not recorded at all (config.json, sweep.json, trials' config_json), so a sweep started before it
    # existed resumes without a difference named; from_dict gives the default back
    assert "eval_calibrations" not in TrainConfig().to_dict() and both.to_dict()["eval_calibrations"] == ("marginal", "class")
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()
    from dpsm_ray.sweep.spec import SweepSpec, settings_differences

    spec = SweepSpec(name="s", base=TrainConfig(), methods=("ce",), trials=1, final_seeds=1, seed=0)
    before = spec.describe()  # as a sweep.json of the release before: no eval_calibrations in its base
    assert "eval_calibrations" not in before["base"] and settings_differences(before, spec.describe()) == []
    assert settings_differences(before, SweepSpec(name="s", base=both, methods=("ce",), trials=1, final_seeds=1, seed=0).describe()) == [
        '--eval-calibrations: None there, ["marginal", "class"] here']
    assert TrainConfig(eval_scores=("hps", "aps", "raps", "saps")).config_hash() != TrainConfig().config_hash()
    # dpsm-ray train's options read them as lists of names
    from dpsm_ray.cli import build_parser, config_from_args

    args = build_parser().parse_args(["train", "--eval-scores", "saps", "topk", "margin", "--eval-calibrations", "marginal", "class"])
    config = config_from_args(args)
    assert config.eval_scores == ("saps", "topk", "margin") and config.eval_calibrations == ("marginal", "class")


def test_config_hash_tells_apart_worker_counts_and_split_seeds():
    # W workers without SyncBatchNorm train another BatchNorm model; the split decides the data
    assert TrainConfig().config_hash() != TrainConfig(workers=2).config_hash()
    assert TrainConfig().config_hash() != TrainConfig(split_seed=5).config_hash()


def test_the_split_seed_chooses_the_data_and_the_run_seed_the_rest():
    from dpsm_ray.train.loop import load_data

    cpu = torch.device("cpu")
    ids = lambda config: {name: getattr(load_data(config, cpu), name).ids.tolist() for name in ("train", "val", "cal", "test")}
    assert ids(TrainConfig(seed=1, split_seed=0)) == ids(TrainConfig(seed=0))
    assert ids(TrainConfig(seed=1)) != ids(TrainConfig(seed=0))
    assert TrainConfig(seed=4).data_seed() == 4 and TrainConfig(seed=4, split_seed=0).data_seed() == 0


def test_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(data_root="data", cache_dir="~/cache").with_absolute_paths()
    assert config.data_root == str(tmp_path / "data") and config.cache_dir.startswith("/") and "~" not in config.cache_dir


def test_round_trips_through_a_dict():
    config = TrainConfig(milestones=(3, 7), eval_scores=("hps",))
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("schedule,milestones,expected", [
    ("step", (2, 4), [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]),  # x0.5 at epochs 2 and 4 (0-based)
    ("exp", (2, 4), [1.0, 1.0, 0.5, 0.25, 0.125, 0.0625]),  # x0.5 after every epoch from epoch 2 on
    ("exp", (), [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]),  # ... from the first epoch on
    ("step", (), [1.0] * 6),
])
def test_learning_rate_schedules_by_hand(schedule, milestones, expected):
    from dpsm_ray.train.loop import lr_scheduler

    config = TrainConfig(lr=1.0, lr_decay=0.5, milestones=milestones, lr_schedule=schedule)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    scheduler = lr_scheduler(optimizer, config)
    lrs = []
    for _ in expected:
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx(expected)
    # what a resumed run restores
    restored = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    again = lr_scheduler(restored, config)
    again.load_state_dict(scheduler.state_dict())
    restored.load_state_dict(optimizer.state_dict())
    assert restored.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])


def test_the_default_gamma_is_spread_over_the_steps_of_an_epoch():
    # digits: 1000 training examples, halves of 500, 32 per half-batch: 15 steps per epoch
    assert TrainConfig(batch_size=64).steps_per_epoch(1000) == 15
    assert TrainConfig(batch_size=64).resolved_quantile_lr(1000) == pytest.approx(2.0 / 15)
    assert TrainConfig(batch_size=128).resolved_quantile_lr(45000) == pytest.approx(2.0 / 351)  # CIFAR-100 at batch 128
    assert TrainConfig(quantile_lr=0.01).resolved_quantile_lr(1000) == 0.01  # an explicit gamma is per step, as in the paper


def test_an_alpha_the_calibration_splits_cannot_resolve_is_warned_about():
    """Issue 21: --alpha 0.001 on digits (200 calibration points) gives q = inf and every class in
    every set, correctly, but without a word.  min_calibration_size is checked against the rank."""
    from dpsm_ray.conformal import conformal_rank, min_calibration_size
    from dpsm_ray.config import calibration_warnings

    for alpha in (0.5, 0.3, 0.1, 0.05, 0.01, 0.001, 0.7, 0.9):
        n = min_calibration_size(alpha)
        assert conformal_rank(n, alpha) <= n and (n == 0 or conformal_rank(n - 1, alpha) > n - 1), alpha
    assert min_calibration_size(0.1) == 9 and min_calibration_size(0.001) == 999
    assert calibration_warnings(TrainConfig(dataset="digits", alpha=0.1)) == []
    warnings = calibration_warnings(TrainConfig(dataset="digits", alpha=0.001))
    assert len(warnings) == 2 and "needs at least 999 calibration points" in warnings[0] and "the calibration split has 200" in warnings[0]
    assert "half of the validation split (what the search calibrates on) has 150" in warnings[1] and "every prediction set will hold every class" in warnings[1]
    only_validation = calibration_warnings(TrainConfig(dataset="digits", alpha=0.005))  # 199 needed: 200 suffice, 150 do not
    assert len(only_validation) == 1 and "validation" in only_validation[0]
    assert calibration_warnings(TrainConfig(dataset="digits", alpha=0.0067)) == []  # 149 needed


def test_every_place_that_lists_settings_reads_the_fields_metadata():
    """A training option is declared once, on its TrainConfig field (``option``) or its card's ``MethodOption``: dpsm-ray train's
    options, the sweep scripts' options, trials.parquet's configuration columns and the report's
    settings table are all derived from the fields' marks."""
    import argparse

    from dpsm_ray.cli import build_parser
    import dataclasses

    from dpsm_ray.cards.methods import CONFIG_FIELDS
    from dpsm_ray.config import SETTING_LABELS, config_specs, fields_marked
    from dpsm_ray.results.provenance import PARAMETERS
    from dpsm_ray.storage.schema import TRIALS
    from dpsm_ray.sweep.cli import build_parser as sweep_parser

    def flags(parser):
        return {a.dest for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}

    train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    specs = config_specs()  # the fields, and the cards' method options after conformal_weight
    assert CONFIG_FIELDS == {spec.name for spec in dataclasses.fields(TrainConfig)}  # the cards' copy, which an option may not be named as
    on_cli = {name for name, spec in specs.items() if spec.metadata.get("cli", True)}
    assert on_cli <= flags(train)
    sweep = flags(sweep_parser("digits", "a sweep", {"trials": 2, "final_seeds": 1, "config": {"dataset": "digits"}}))
    fields = set(specs)
    assert sweep & fields == set(fields_marked("sweep")) | {"seed", "download"}  # --seed and --download: the sweep's own options
    columns = list(TRIALS)
    assert columns[columns.index("wall_seconds") + 1 : columns.index("config_json")] == list(fields_marked("column"))
    assert PARAMETERS == SETTING_LABELS and list(SETTING_LABELS) == [name for name, spec in specs.items() if "label" in spec.metadata]
    # the marks themselves: a path is absolute for the trials; an operational field leaves the hash alone
    assert TrainConfig(data_root="data").with_absolute_paths().data_root.startswith("/")
    assert TrainConfig(data_workers=1).config_hash() == TrainConfig(data_workers=2).config_hash()
    assert TrainConfig(lr=0.1).config_hash() != TrainConfig(lr=0.2).config_hash()
