"""The ``dpsm-ray`` command.

    dpsm-ray train --dataset digits --method dpsm --epochs 30 --seed 0 --out runs/dpsm
    dpsm-ray report results/digits

``train`` options are generated from ``TrainConfig``'s fields, so ``--help`` documents every one
and errors name the option as it was typed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from dpsm_ray.train.config import ConfigError, TrainConfig, calibration_warnings
from dpsm_ray.train.presets import PRESET_NAMES, preset_values
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (the error names the value)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0; got {text!r}")
    return value


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", "--" + field.name.replace("_", "-"))


def add_config_options(parser: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(TrainConfig):
        if not field.metadata.get("cli", True):
            continue
        flag, default, help_text = _flag(field), field.default, field.metadata["help"]
        kwargs = {"dest": field.name, "default": argparse.SUPPRESS, "help": f"{help_text} (default: {default})"}
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", **kwargs)
        elif isinstance(default, tuple) or "nargs" in field.metadata:
            item_type = field.metadata.get("type", str if field.name == "eval_scores" else int)
            parser.add_argument(flag, nargs="*", type=item_type, **kwargs)
        else:
            parser.add_argument(flag, type=field.metadata.get("type", type(default)), **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The options given, over the preset's settings for the method (``--preset``), over the defaults."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    if args.preset:
        values = {**preset_values(args.preset, values.get("method", TrainConfig.method)), **values}
    return TrainConfig.from_dict(values).with_absolute_paths()


def flag_for(field_name: str) -> str:
    for field in dataclasses.fields(TrainConfig):
        if field.name == field_name:
            return _flag(field)
    return field_name


def fail(parser: argparse.ArgumentParser, error: ConfigError) -> None:
    parser.exit(2, f"{parser.prog}: error: {flag_for(error.field)}={error.value!r} is invalid: {error.allowed}\n")


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import pandas as pd

    try:
        config = config_from_args(args)
    except ConfigError as error:
        fail(parser, error)
    from dpsm_ray.data import check_data_present
    from dpsm_ray.files import CorruptFileError, is_disk_full
    from dpsm_ray.results import write_run
    from dpsm_ray.results.tables import format_summary, summarise
    from dpsm_ray.train import run_training
    from dpsm_ray.train.ray_session import InsufficientResources, leaving_ray_as_it_was

    for line in calibration_warnings(config):
        print(f"warning: {line}", file=sys.stderr)
    out = Path(args.out).resolve() if args.out else None
    again = "; run the same command again to continue from the last checkpoint" if out is not None else ""
    ray_options = {"resource_timeout_s": args.resource_timeout} if config.workers else {}
    with leaving_ray_as_it_was():
        try:
            check_data_present(config.dataset, config.data_root, config.download)  # before any Ray work starts
            result = run_training(config, out, **ray_options)
            if out is not None:
                write_run(out, result)
        except ConfigError as error:
            fail(parser, error)
        except (FileNotFoundError, InsufficientResources, CorruptFileError) as error:  # a missing dataset or weights file; workers that cannot start
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        except KeyboardInterrupt:
            parser.exit(3, f"{parser.prog}: interrupted{again}\n")
        except Exception as error:
            if not is_disk_full(error):
                raise
            parser.exit(3, f"{parser.prog}: error: {str(error).splitlines()[-1]}{again}\n")
    print(f"{config.method} on {config.dataset}, alpha={config.alpha}: test metrics over {config.eval_splits} calibration/test re-splits")
    print(format_summary(summarise(pd.DataFrame(result.evals))))
    if out is not None:
        print(f"results written to {out}")
    return 0


def cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dpsm_ray.files import CorruptFileError
    from dpsm_ray.results.report import write_report

    directory = Path(args.directory)
    if not directory.is_dir():
        parser.exit(2, f"{parser.prog}: error: {directory} is not a directory (give a sweep's --results-dir or a run's --out)\n")
    try:
        write_report(directory)
    except (FileNotFoundError, CorruptFileError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpsm-ray", description="Conformal classifier training (DPSM, ConfTr, CUT, CE) on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train and evaluate one model",
        description="Train one model with the chosen objective, print a progress line per epoch and a final table.",
    )
    add_config_options(train)
    train.add_argument("--preset", choices=PRESET_NAMES, help="official: train the method as its official code does (DPSM's: "
                       "T 1, lambda 0.05, q step 0.01, CE on the whole batch, each batch split in place, 40 epochs from the CE base "
                       "model with the lr restarted at 0.1 and divided by 10 at epoch 25; ConfTr as published: Stutz et al.'s "
                       "Fashion-MNIST settings); options given here override it (docs/method.md)")
    train.add_argument("--resource-timeout", type=positive_seconds, default=DEFAULT_RESOURCE_TIMEOUT_S, metavar="SECONDS",
                       help="with --workers on a Ray cluster: how long to wait for the CPUs/GPUs the workers ask for before giving up "
                       "(an embedded Ray fails at once; default: %(default)s)")
    train.add_argument("--out", help="write config.json, splits.json, epochs.parquet, evals.parquet, classes.parquet and a checkpoint here; "
                       "running again with the same directory resumes from the checkpoint")
    train.set_defaults(handler=cmd_train, parser=train)
    report = commands.add_parser(
        "report",
        help="print the paper-style tables of a sweep or run and write report.md and figures",
        description="Read DIR/evals.parquet, epochs.parquet and classes.parquet (a sweep's --results-dir or a run's --out); print the "
        "set-size table (mean ± std per method and score, DPSM against the best baseline) and all metrics; write "
        "DIR/report.md and DIR/figures/*.png (coverage and set-size box plots, losses and their gaps, |q - Q_n|, "
        "training against validation set size, class-conditional coverage).",
    )
    report.add_argument("directory", metavar="DIR", help="a sweep's results directory or a training run's --out directory")
    report.set_defaults(handler=cmd_report, parser=report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args, args.parser)


if __name__ == "__main__":
    sys.exit(main())
