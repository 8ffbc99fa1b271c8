"""Search spaces, the paper grid, sweep settings and the sweep scripts' command line (no Ray)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from dpsm_ray.sweep.cli import build_parser, main, spec_from_args
from dpsm_ray.sweep.driver import SweepSpec
from dpsm_ray.sweep.space import DEFAULT_RANGES, PAPER_GRID, Range, grid_size, paper_grid, parse_range, search_space
from dpsm_ray.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def test_paper_grid_sizes_match_spec_section_4():
    # batch 2 x epochs 3 x lr 5 x milestones 3 x decay 2 = 180; x conformal_weight 6; x quantile_lr 8
    assert grid_size(paper_grid("ce")) == 180
    assert grid_size(paper_grid("cut")) == 180 * 6
    assert grid_size(paper_grid("conftr")) == 180 * 6
    assert grid_size(paper_grid("dpsm")) == 180 * 6 * 8
    axes = paper_grid("dpsm")
    assert axes["conformal_weight"] == PAPER_GRID["conformal_weight"] and axes["quantile_lr"] == PAPER_GRID["quantile_lr"]


def test_paper_grid_fix_and_subset_axes():
    axes = paper_grid("dpsm", fixed={"batch_size": 128, "epochs": 40}, subsets={"lr": (0.01, 0.1)})
    assert axes["batch_size"] == (128,) and axes["epochs"] == (40,) and axes["lr"] == (0.01, 0.1)
    assert grid_size(axes) == 1 * 1 * 2 * 3 * 2 * 6 * 8
    with pytest.raises(ValueError, match="grid axis must be one of .*got 'momentum'"):
        paper_grid("ce", fixed={"momentum": 0.9})


def test_parse_range_and_errors():
    assert parse_range("conformal_weight=0.01:1") == ("conformal_weight", Range(0.01, 1.0, log=True))
    assert parse_range("sigmoid_temperature=0.1:2:linear") == ("sigmoid_temperature", Range(0.1, 2.0, log=False))
    for text, message in [
        ("eta=0.1:1", "unknown knob 'eta'"),
        ("lr=0.1", "expected lr=LOW:HIGH"),
        ("lr=a:b", "must be numbers"),
        ("lr=1:0.1", r"^--range 'lr=1:0.1': range must have finite low < high"),  # the option named (it said "range" alone)
        ("lr=0:1", r"^--range 'lr=0:1': a log-uniform range needs low > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_range(text)


def test_search_space_per_method_uses_log_uniform_paper_bounds():
    from ray.tune.search.sample import Float

    space = search_space("dpsm")
    assert set(space) == {"conformal_weight", "lr", "quantile_lr", "sigmoid_temperature"}
    assert set(search_space("ce")) == {"lr"}
    assert set(search_space("cut")) == {"conformal_weight", "lr"}
    assert set(search_space("conftr")) == {"conformal_weight", "lr", "sigmoid_temperature"}
    lam = space["conformal_weight"]
    assert isinstance(lam, Float) and (lam.lower, lam.upper) == (0.01, 5.0)
    assert type(lam.get_sampler()).__name__ == "_LogUniform"
    overridden = search_space("dpsm", {"quantile_lr": Range(0.001, 0.01)})["quantile_lr"]
    assert (overridden.lower, overridden.upper) == (0.001, 0.01)
    assert DEFAULT_RANGES["quantile_lr"].low == min(PAPER_GRID["quantile_lr"]) and DEFAULT_RANGES["quantile_lr"].high == max(PAPER_GRID["quantile_lr"])


def base(**changes):
    return TrainConfig(**{"dataset": "digits", "epochs": 2, **changes})


@pytest.mark.parametrize("kwargs, field", [
    ({"methods": ("ce", "dpsn")}, "methods"),
    ({"methods": ()}, "methods"),
    ({"trials": 0}, "trials"),
    ({"final_seeds": 0}, "final_seeds"),
    ({"coverage_slack": 0.95}, "coverage_slack"),  # allowed: [0, 1 - alpha)
    ({"coverage_slack": -0.01}, "coverage_slack"),
    ({"concurrency": 0}, "concurrency"),
])
def test_sweep_spec_rejects_bad_settings(kwargs, field):
    with pytest.raises(ConfigError) as error:
        SweepSpec(name="t", base=base(), **kwargs)
    assert error.value.field == field


def test_sweep_spec_validates_the_configs_its_ranges_produce():
    # a linear range reaching a negative lambda would make invalid trial configs: caught up front,
    # named as the option the user typed
    with pytest.raises(ConfigError) as error:
        SweepSpec(name="t", base=base(), ranges=(("conformal_weight", Range(-1.0, 1.0, log=False)),))
    assert (error.value.field, error.value.value) == ("range", "conformal_weight=-1:1")
    assert "conformal_weight=-1.0" in error.value.allowed and "must be >= 0" in error.value.allowed


@pytest.mark.parametrize("kwargs, field, value", [
    ({"grid_subsets": (("lr", (0.01, -1.0)),)}, "subset", "lr=-1.0"),  # not only the grid's first point
    ({"grid_subsets": (("batch_size", (64, 66)),)}, "subset", "batch_size=66"),  # 66 leaves a partial worker slice
    ({"grid_fixed": (("epochs", 0),)}, "fix", "epochs=0"),
    ({"base": base(train_subset=100)}, "grid", "batch_size=128"),  # the paper grid's batch 128 > 100 examples
])
def test_sweep_spec_validates_every_value_of_the_grid(kwargs, field, value):
    with pytest.raises(ConfigError) as error:
        SweepSpec(**{"name": "t", "base": base(workers=4), "grid": True, **kwargs})
    assert (error.value.field, error.value.value) == (field, value)


def test_sweep_spec_fixes_the_data_split_and_makes_paths_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    spec = SweepSpec(name="t", base=base(data_root="data", seed=3), seed=3)
    assert spec.base.split_seed == 3  # final seeds 3, 4, ... all train on the split the search used
    assert spec.base.data_root == str(tmp_path / "data")
    assert SweepSpec(name="t", base=base(split_seed=7)).base.split_seed == 7  # an explicit one is kept


def test_a_method_whose_every_search_trial_failed_is_left_out_of_the_final_stage(tmp_path):
    import pandas as pd

    from dpsm_ray.storage.schema import TRIALS
    from dpsm_ray.storage.writers import write_parquet
    from dpsm_ray.sweep.driver import best_overrides

    spec = SweepSpec(name="t", base=base(), methods=("ce", "dpsm"))
    config = spec.base.replace(method="ce", lr=0.02).to_dict()
    rows = [
        {"stage": "search", "method": "ce", "trial_id": "a", "status": "ok", "feasible": True, "val_coverage": 0.91, "val_set_size": 1.2, "milestones": [], "config_json": __import__("json").dumps(config)},
        {"stage": "search", "method": "dpsm", "trial_id": "b", "status": "failed", "error": "training loss is nan", "milestones": []},
    ]
    write_parquet(tmp_path / "trials.parquet", pd.DataFrame(rows), TRIALS)
    lines = []
    assert best_overrides(tmp_path, "ce", ("lr",), lines.append) == {"lr": 0.02}
    assert best_overrides(tmp_path, "dpsm", ("lr",), lines.append) is None
    assert "every search trial of dpsm failed" in lines[-1] and "left out of the final stage" in lines[-1]


def test_a_missing_dataset_stops_the_sweep_before_it_claims_the_results_dir(tmp_path):
    from dpsm_ray.sweep.driver import run_sweep

    spec = SweepSpec(name="t", base=base(dataset="cifar100", data_root=str(tmp_path / "data")), methods=("ce",))
    with pytest.raises(FileNotFoundError, match="cifar-100-python.*--download"):
        run_sweep(spec, tmp_path / "results")
    assert not (tmp_path / "results").exists()  # so rerunning with --download is a fresh sweep


def test_sweep_spec_never_evaluates_test_data_in_the_search():
    spec = SweepSpec(name="t", base=base().replace(evaluate_test=True))
    assert spec.base.evaluate_test is False
    assert math.isclose(spec.coverage_floor, 0.9)


DEFAULTS = {"trials": 2, "final_seeds": 1, "config": {"dataset": "digits", "epochs": 2}}


@pytest.mark.parametrize("argv, needle", [
    (["--trials", "0"], "--trials=0 is invalid: must be an integer >= 1"),
    (["--alpha", "1.5"], "--alpha=1.5 is invalid"),
    (["--methods", "ce,foo"], "--methods="),
    (["--range", "conformal_weight=2:1"], "--range 'conformal_weight=2:1': range must have finite low < high"),
    (["--fix", "lr=0.01"], "--fix/--subset/--grid-budget apply to --grid paper"),
    (["--grid", "paper", "--fix", "lr=0.01,0.1"], "give exactly one value"),
    (["--grid", "paper", "--subset", "momentum=0.9"], "unknown grid axis 'momentum'"),
    (["--batch-size", "100000"], "--batch-size=100000 is invalid"),
    (["--dataset", "inaturalist2019"], "--dataset='inaturalist2019' is invalid: dataset must be one of"),
    (["--grid", "paper", "--subset", "lr=0.01,-1"], "--subset='lr=-1.0' is invalid: eta must be > 0 (sets lr=-1.0 for "),
    (["--dataset", "cifar100", "--data-root", "nowhere"], "CIFAR-100 not found at"),
    (["--scheduler", "asha", "--grace-period", "0"], "--grace-period=0 is invalid: must be an integer >= 1 (epochs)"),
    (["--scheduler", "asha", "--reduction-factor", "1"], "--reduction-factor=1 is invalid: must be an integer >= 2"),
    (["--grid", "paper", "--grid-budget", "0"], "--grid-budget=0 is invalid: must be an integer >= 1"),
    (["--trial-retries", "-1"], "--trial-retries=-1 is invalid: must be an integer >= 0"),
    (["--resource-timeout", "0"], "--resource-timeout=0.0 is invalid: must be a number of seconds > 0"),
])
def test_script_errors_name_the_option_before_ray_starts(argv, needle, capsys, tmp_path, no_ray_start):
    with pytest.raises(SystemExit) as exit_:
        main("t", "test", DEFAULTS, ["--results-dir", str(tmp_path / "r"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("script", ["digits", "cifar100", "caltech101", "inaturalist"])
def test_every_sweep_script_documents_the_common_options(script):
    out = subprocess.run([sys.executable, str(ROOT / "sweeps" / f"{script}.py"), "--help"], capture_output=True, text=True, check=True).stdout
    for option in ("--results-dir", "--trials", "--resume", "--seed", "--grid", "--range", "--address"):
        assert option in out


@pytest.mark.parametrize("defaults, argv, expected", [
    ({"dataset": "cifar100", "model": "resnet110", "gpus_per_worker": 1, "workers": 1}, [], 0.25),
    ({"dataset": "cifar100", "model": "auto", "gpus_per_worker": 1, "workers": 1}, [], 0.25),  # auto -> resnet110
    ({"dataset": "cifar100", "model": "resnet110", "gpus_per_worker": 1, "workers": 1}, ["--trials-per-gpu", "2"], 0.5),
    ({"dataset": "cifar100", "model": "resnet110", "gpus_per_worker": 1, "workers": 1}, ["--gpus-per-worker", "1"], 1.0),
    ({"dataset": "cifar100", "model": "densenet100", "gpus_per_worker": 1, "workers": 2}, [], 1.0),  # DDP trials are not packed
    ({"dataset": "caltech101", "model": "resnet50", "gpus_per_worker": 1, "workers": 1}, [], 1.0),
    ({"dataset": "digits", "gpus_per_worker": 0, "workers": 1}, [], 0.0),  # CPU trials: nothing to pack
    ({"dataset": "cifar100", "model": "resnet110", "gpus_per_worker": 1, "workers": 0}, [], 0.25),  # in-process trials (the GPU scripts' default)
    ({"dataset": "caltech101", "model": "resnet50", "gpus_per_worker": 1, "workers": 0}, [], 1.0),
    ({"dataset": "cifar100", "model": "densenet100", "gpus_per_worker": 1, "workers": 0}, [], 0.25),  # DenseNet-BC-100: 32x32, packed
    ({"dataset": "caltech101", "model": "densenet121", "gpus_per_worker": 1, "workers": 0}, [], 1.0),  # ImageNet-size: a GPU each
])
def test_gpu_trials_are_packed_by_model_size_unless_overridden(defaults, argv, expected, tmp_path):
    script = {"trials": 2, "final_seeds": 1, "config": {"batch_size": 64, **defaults}}
    args = build_parser("t", "test", script).parse_args(["--results-dir", str(tmp_path), *argv])
    spec = spec_from_args("t", args, script)
    assert spec.base.gpus_per_worker == expected
    # a trial that trains in its own process holds its GPU share itself; a Ray Train trial's
    # process only drives its workers
    own = dict(spec.trial_resources)
    assert own == ({"cpu": spec.base.cpus_per_worker, "gpu": expected} if spec.base.workers == 0 and expected else
                   {"cpu": spec.base.cpus_per_worker} if spec.base.workers == 0 else {"cpu": 0.1})


def test_trials_per_gpu_must_be_auto_or_a_positive_integer(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main("t", "test", DEFAULTS, ["--results-dir", str(tmp_path / "r"), "--trials-per-gpu", "0"])
    assert exit_.value.code == 2 and "--trials-per-gpu must be auto or an integer >= 1; got '0'" in capsys.readouterr().err


def test_a_grid_budget_is_a_seeded_random_subset_in_grid_order():
    from dpsm_ray.sweep.driver import grid_points

    axes = {"lr": (0.01, 0.1), "conformal_weight": (0.1, 0.5, 1.0)}
    every = grid_points(axes, None, seed=0)
    assert every == [{"lr": lr, "conformal_weight": w} for lr in (0.01, 0.1) for w in (0.1, 0.5, 1.0)]
    assert grid_points(axes, 10, seed=0) == every
    some = grid_points(axes, 4, seed=7)
    assert len(some) == 4 and some == [p for p in every if p in some]  # in grid order
    assert grid_points(axes, 4, seed=7) == some and any(grid_points(axes, 4, seed=s) != some for s in range(8))


def test_a_new_sweep_refuses_an_optuna_storage_that_already_holds_its_studies(tmp_path):
    import optuna

    from dpsm_ray.sweep.driver import SweepError, check_results_dir

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    spec = SweepSpec(name="t", base=base(), methods=("ce", "dpsm"), optuna_storage=storage)
    results = tmp_path / "digits"
    assert check_results_dir(spec, results, resume=False)
    optuna.create_study(study_name="digits-dpsm", storage=storage)  # another sweep whose results dir had the same name
    with pytest.raises(SweepError, match="already holds the studies digits-dpsm"):
        check_results_dir(spec, results, resume=False)


# --- one name per knob (issue 22): the config field's; an earlier release's name still works, warned
def test_an_earlier_releases_knob_names_work_with_a_warning_and_become_the_field_names():
    with pytest.warns(FutureWarning, match="'lambda' is now called 'conformal_weight'"):
        assert parse_range("lambda=0.01:1") == ("conformal_weight", Range(0.01, 1.0))
    with pytest.warns(FutureWarning) as warned:
        args = build_parser("digits", "", {"trials": 2, "final_seeds": 1, "config": {"dataset": "digits"}}).parse_args(
            ["--grid", "paper", "--fix", "gamma=0.01", "--subset", "lambda=0.1,0.5", "--subset", "lr=0.01,0.1"])
        spec = spec_from_args("digits", args, {"trials": 2, "final_seeds": 1, "config": {"dataset": "digits"}})
    assert [str(w.message).split(":")[0] for w in warned] == ["--fix gamma=0.01", "--subset lambda=0.1,0.5"]
    assert dict(spec.grid_fixed) == {"quantile_lr": 0.01} and set(dict(spec.grid_subsets)) == {"conformal_weight", "lr"}
    with pytest.warns(FutureWarning, match="SweepSpec.ranges: 'temperature'"):
        built = SweepSpec(name="t", base=base(), ranges=(("temperature", Range(0.1, 0.5)),))
    assert built.describe()["ranges"] == [["sigmoid_temperature", {"low": 0.1, "high": 0.5, "log": True}]]
    assert built == SweepSpec(name="t", base=base(), ranges=(("sigmoid_temperature", Range(0.1, 0.5)),))


def test_the_training_cli_takes_the_old_flags_with_a_warning():
    import argparse

    from dpsm_ray.config import add_config_options

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    with pytest.warns(FutureWarning, match="--lambda is now --conformal-weight"):
        args = parser.parse_args(["--lambda", "0.5", "--sigmoid-temperature", "0.2"])
    assert (args.conformal_weight, args.sigmoid_temperature) == (0.5, 0.2)
    with pytest.warns(FutureWarning, match="--temperature is now --sigmoid-temperature"):
        assert parser.parse_args(["--temperature", "0.3"]).sigmoid_temperature == 0.3


def test_a_process_per_trial_is_an_option_that_does_not_change_what_a_sweep_computes():
    defaults = {"trials": 2, "final_seeds": 1, "config": {"dataset": "digits"}}
    parser = build_parser("digits", "", defaults)
    reused, fresh = (spec_from_args("digits", parser.parse_args(argv), defaults) for argv in ([], ["--process-per-trial"]))
    assert (reused.process_per_trial, fresh.process_per_trial) == (False, True)
    assert reused == fresh and reused.describe() == fresh.describe()  # a resumed sweep may change it
