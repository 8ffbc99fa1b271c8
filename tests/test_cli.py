import re

import pandas as pd
import pytest

from dpsm_ray.cli import build_parser, main
from dpsm_ray.storage.schema import EPOCHS, EVALS
from dpsm_ray.config import TrainConfig, config_specs


def test_train_prints_a_table_and_writes_the_documented_files(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--dataset", "digits", "--method", "dpsm", "--epochs", "2", "--eval-splits", "3", "--out", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "epoch   1/2" in captured.err and "epoch   2/2" in captured.err
    for score in TrainConfig().eval_scores:
        assert score in captured.out
    epochs = pd.read_parquet(out / "epochs.parquet")
    evals = pd.read_parquet(out / "evals.parquet")
    assert list(epochs.columns) == list(EPOCHS) and len(epochs) == 2
    assert list(evals.columns) == list(EVALS) and len(evals) == len(TrainConfig().eval_scores) * 3  # scores x re-splits
    assert (out / "config.json").exists() and (out / "splits.json").exists()
    assert not list(out.glob(".*tmp"))


def test_train_evaluates_the_new_scores_marginally_and_class_conditionally(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--dataset", "digits", "--method", "ce", "--epochs", "1", "--eval-splits", "2", "--eval-scores", "saps", "topk",
                 "margin", "--eval-calibrations", "marginal", "class", "--out", str(out)])
    assert code == 0
    evals, classes = pd.read_parquet(out / "evals.parquet"), pd.read_parquet(out / "classes.parquet")
    assert len(evals) == 3 * 2 * 2 and set(evals.score) == {"saps", "topk", "margin"} and set(evals.calibration) == {"marginal", "class"}
    assert evals[evals.calibration == "class"].q.isna().all() and evals[evals.calibration == "marginal"].q.notna().all()
    assert len(classes) == len(evals) * 10 and set(classes.calibration) == {"marginal", "class"}
    printed = capsys.readouterr().out
    assert re.search(r"^score\s+calibration\s+coverage", printed, re.M) and re.search(r"^topk\s+class\s+0\.\d{3} ± ", printed, re.M), printed


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--alpha", "1.5"], "--alpha=1.5 is invalid: must be in the open interval (0, 1)"),
        (["--conformal-weight", "-1"], "--conformal-weight=-1.0 is invalid: must be >= 0 (the paper's lambda)"),
        (["--method", "thr"], "--method='thr' is invalid: must be one of ce, conftr, conftr_published, confts, cut, dpsm, rwce, vr_conftr, or base"),
        (["--batch-size", "4096"], "--batch-size=4096 is invalid: must be at most 1000"),
        (["--sigmoid-temperature", "-2"], "--sigmoid-temperature=-2.0 is invalid: must be > 0"),
    ],
)
def test_invalid_values_exit_with_one_line_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_help_documents_every_option():
    subparsers = build_parser()._subparsers._group_actions[0].choices
    text = subparsers["train"].format_help()
    specs = config_specs()  # the fields and the method options
    hidden = {name for name, spec in specs.items() if not spec.metadata.get("cli", True)}
    assert hidden == {"init_checkpoint", "evaluate_test", "options"}  # set by the base-model cache and the sweep; the options by name
    assert {"sigmoid_temperature", "rank_exponent"} <= set(specs)
    for name in set(specs) - hidden:
        assert "--" + name.replace("_", "-") in text
    assert "--out" in text


def test_cifar100_resnet110_dpsm_runs_end_to_end_on_a_generated_copy(tmp_path, capsys):
    from fake_datasets import write_cifar100

    write_cifar100(tmp_path / "data")
    code = main([
        "train", "--dataset", "cifar100", "--data-root", str(tmp_path / "data"), "--model", "resnet110", "--method", "dpsm",
        "--epochs", "1", "--batch-size", "32", "--eval-splits", "2", "--out", str(tmp_path / "run"),
    ])
    assert code == 0
    assert "epoch   1/1" in capsys.readouterr().err
    assert len(pd.read_parquet(tmp_path / "run" / "evals.parquet")) == 6
    splits = __import__("json").loads((tmp_path / "run" / "splits.json").read_text())
    every_id = [i for name in ("train", "val", "cal", "test") for i in splits[name]]
    assert len(every_id) == len(set(every_id))


def test_train_accepts_auto_step_and_precision_on_a_cpu(tmp_path, capsys):
    code = main(["train", "--dataset", "digits", "--method", "ce", "--epochs", "1", "--eval-splits", "2", "--step", "auto", "--precision", "auto",
                 "--out", str(tmp_path / "run")])
    assert code == 0
    assert "--step" not in capsys.readouterr().err  # the plain path on a CPU: nothing to announce


def test_a_missing_dataset_names_the_path_and_the_download_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--dataset", "cifar100", "--data-root", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "cifar-100-python") in err and "--download" in err


def test_the_official_preset_trains_as_the_official_code_and_options_given_win(tmp_path, capsys):
    """Issue 28: `--preset official` sets every setting as the official DPSM code has it; read back
    from the run's config.json.  An option given on the command line (--epochs) overrides it."""
    import json

    code = main(["train", "--preset", "official", "--method", "dpsm", "--dataset", "digits", "--epochs", "1", "--base-epochs", "2",
                 "--eval-splits", "2", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "run")])
    assert code == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    official = {"sigmoid_temperature": 1.0, "conformal_weight": 0.05, "quantile_lr": 0.01, "ce_batch": "full", "dpsm_split": "batch",
                "init": "base", "batch_size": 128, "lr": 0.1, "milestones": [25], "lr_decay": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    assert {name: config[name] for name in official} == official
    assert config["epochs"] == 1 and config["init_checkpoint"].endswith("model.pt")
    published = build_parser().parse_args(["train", "--preset", "official", "--method", "conftr_published"])
    from dpsm_ray.cli import config_from_args

    stutz = config_from_args(published)
    assert (stutz.init, stutz.epochs, stutz.batch_size, stutz.lr, stutz.milestones, stutz.nesterov, stutz.weight_decay) == ("scratch", 150, 100, 0.01, (60, 90, 120), True, 1e-3)
    assert (stutz.sigmoid_temperature, stutz.conformal_weight, stutz.size_target, stutz.ce_weight, stutz.sort_temperature) == (0.1, 0.01, 0.0, 0.0, 0.1)


def test_version_names_the_package_and_python():
    import subprocess
    import sys
    from pathlib import Path

    from dpsm_ray import __version__

    script = Path(__file__).resolve().parents[1] / "sweeps" / "digits.py"
    for command, name in ((["-m", "dpsm_ray.cli"], "dpsm-ray"), ([str(script)], "dpsm_ray")):
        result = subprocess.run([sys.executable, *command, "--version"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == f"{name} {__version__} (Python {sys.version.split()[0]})", result


@pytest.mark.parametrize("command,argv,message", [
    ("dpsm-ray", ["train", "--epoch", "1"], "dpsm-ray train: error: unrecognized arguments: --epoch 1; did you mean --epochs?"),
    ("dpsm-ray", ["predict", "p", "--input", "x.npy", "--out", "o.parquet", "--scor", "aps"], "dpsm-ray predict: error: unrecognized arguments: --scor aps; did you mean --score?"),
    ("dpsm-ray", ["train", "--zzz", "1"], "dpsm-ray train: error: unrecognized arguments: --zzz 1; dpsm-ray train --help lists its options"),
    ("digits", ["--trial", "3"], "sweeps/digits.py: error: unrecognized arguments: --trial 3; did you mean --trials?"),
])
def test_an_abbreviated_or_unknown_option_is_refused_in_one_line_with_the_nearest_one(command, argv, message, capsys):
    """argparse would take ``--epoch 1`` for ``--epochs 1`` (abbreviations) and print the top-level usage for an unknown one."""
    from dpsm_ray.sweep.cli import main as sweep_main

    with pytest.raises(SystemExit) as exit_info:
        main(argv) if command == "dpsm-ray" else sweep_main("digits", "digits", {"trials": 4, "final_seeds": 2, "config": {"dataset": "digits"}}, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err == [message]


def test_train_out_reused_with_other_options_or_over_changed_data_is_one_line_naming_them(tmp_path, capsys):
    from sklearn.datasets import load_iris

    from dpsm_ray.files import read_checked_json

    frame = load_iris(as_frame=True).frame
    frame.to_csv(tmp_path / "iris.csv", index=False)
    dataset, out = f"table:{tmp_path / 'iris.csv'}:label=target", tmp_path / "run"
    argv = ["train", "--dataset", dataset, "--method", "ce", "--epochs", "1", "--eval-splits", "2", "--out", str(out)]
    assert main(argv) == 0
    recorded = read_checked_json(out / "settings.json")["data"]
    assert recorded["kind"] == "file" and recorded["path"] == str(tmp_path / "iris.csv") and len(recorded["sha256"]) == 64
    assert read_checked_json(out / "predictor" / "predictor.json")["provenance"]["data"] == recorded
    assert main(argv) == 0  # the same command again: the same run
    capsys.readouterr()

    def refused(arguments) -> str:
        with pytest.raises(SystemExit) as ended:
            main(arguments)
        err = capsys.readouterr().err.strip().splitlines()
        assert ended.value.code == 2 and len(err) == 1, err
        return err[0]

    line = refused([*argv[:5], "--epochs", "2", *argv[7:]])
    assert f"--out {out} holds a run started with other options (--epochs 1 there, 2 here); give those options" in line
    # the labels shuffled in place, at the same path, the same size: the old results would answer for other data
    frame.assign(target=frame.target.sample(frac=1, random_state=0).to_numpy()).to_csv(tmp_path / "iris.csv", index=False)
    line = refused(argv)
    assert f"--out {out} holds a run of other data than {dataset} holds now -- {tmp_path / 'iris.csv'}: its content differs" in line
    assert main(["report", str(out)]) == 0
    assert f"warning: these results were made from other data than {dataset} holds now" in capsys.readouterr().out
    assert "**Warning:** these results were made from other data" in (out / "report.md").read_text()
