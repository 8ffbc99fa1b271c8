"""The ``dpsm-ray`` command.

    dpsm-ray train --dataset digits --method dpsm --epochs 30 --seed 0 --out runs/dpsm
    dpsm-ray sweep --dataset fonts --methods ce,dpsm --trials-per-knob 4 [--config FILE.yaml]
    dpsm-ray report results/digits
    dpsm-ray export results/digits --method dpsm --out predictors/dpsm
    dpsm-ray export predictors/dpsm --format onnx --out portable/dpsm
    dpsm-ray calibrate --model mlp --weights model.pt --dataset digits --out predictors/mine
    dpsm-ray predict predictors/dpsm --input digits.npy --out sets.parquet
    dpsm-ray serve predictors/dpsm

``train`` options are generated from ``TrainConfig``'s fields, so ``--help`` documents every one
and errors name the option as it was typed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from dpsm_ray.cards import model_choices, score_names
from dpsm_ray.cards import BASE_MODEL, METHODS
from dpsm_ray.sweep.options import version_line
from dpsm_ray.timing import skip_final_collection
from dpsm_ray.config import ConfigError, TrainConfig, add_config_options, calibration_warnings, check_pretrained, config_specs
from dpsm_ray.train.presets import PRESET_NAMES, preset_values
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S

PREDICTOR_DIR = "predictor"  # where `train --out DIR` writes its predictor: DIR/predictor/


def _checked(convert, ok, wanted: str):
    """An argparse type: the text as ``convert`` reads it, where ``ok`` allows it (the error names the value)."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}; got {text!r}")
        return value

    return parse


_positive_seconds = _checked(float, lambda value: value > 0 and math.isfinite(value), "a number of seconds > 0")
_positive_int = _checked(int, lambda value: value >= 1, "an integer >= 1")
_port_number = _checked(int, lambda value: 1 <= value <= 65535, "a port number in 1..65535")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The options given, over the preset's settings for the method (``--preset``), over the defaults."""
    names = set(config_specs())
    values = {k: v for k, v in vars(args).items() if k in names}
    if args.preset:
        values = {**preset_values(args.preset, values.get("method", TrainConfig.method)), **values}
    return TrainConfig.from_dict(values).with_absolute_paths()


def _flag_for(field_name: str) -> str:
    return "--" + field_name.replace("_", "-") if field_name in config_specs() else field_name


def fail(parser: argparse.ArgumentParser, error: ConfigError) -> None:
    parser.exit(2, f"{parser.prog}: error: {_flag_for(error.field)}={error.value!r} is invalid: {error.allowed}\n")


def _cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as error:
        fail(parser, error)
    import pandas as pd

    from dpsm_ray.cards import check_data_present, is_factory
    from dpsm_ray.storage import write_run
    from dpsm_ray.results.tables import format_summary, summarise
    from dpsm_ray.sweep.exits import exit_codes
    from dpsm_ray.train import run_training
    from dpsm_ray.train.ray_session import leaving_ray_as_it_was

    for line in calibration_warnings(config):
        print(f"warning: {line}", file=sys.stderr)
    out = Path(args.out).resolve() if args.out else None
    again = "run the same command again to continue from the last checkpoint" if out is not None else "nothing was saved (without --out)"
    ray_options = {"resource_timeout_s": args.resource_timeout} if config.workers else {}
    predictor = None
    with exit_codes(parser, again=again, where=lambda: out, flag=_flag_for), leaving_ray_as_it_was():
        check_data_present(config.dataset, config.data_root, config.download)  # before any Ray work starts
        check_pretrained(config)
        if out is not None:
            _claim_run_dir(out, config, parser)
        result = run_training(config, out, **ray_options)
        if out is not None:
            from dpsm_ray.predict.export import chance_line, predictor_for_run

            write_run(out, result)
            from dpsm_ray.storage.layout import read_run_settings

            predictor = predictor_for_run(config, result.model_state, provenance={"source": "dpsm-ray train --out", "out": str(out),
                                                                                  "data": read_run_settings(out)["data"]})
            predictor.save(out / PREDICTOR_DIR, overwrite=True)  # a rerun of the same --out (it resumed) replaces it
    print(f"{config.method} on {config.dataset}, alpha={config.alpha}: test metrics over {config.eval_splits} calibration/test re-splits")
    evals = pd.DataFrame(result.evals)
    by = ("score", "calibration") if evals["calibration"].nunique() > 1 else ("score",)  # --eval-calibrations marginal class: a line each
    print(format_summary(summarise(evals, by), by))
    if out is None:
        print("nothing was saved: pass --out DIR to keep the model as a predictor (and the results as Parquet files)")
        return 0
    print(f"results written to {out}")
    hps = predictor.info["test"]["scores"]["hps"]
    print(f"predictor written to {out / PREDICTOR_DIR} (calibrated on the calibration split: HPS q {predictor.thresholds['hps']:.4f}; "
          f"on the test split coverage {hps['coverage']:.3f}, set size {hps['set_size']:.2f}); use it with "
          f"dpsm-ray predict {out / PREDICTOR_DIR} --input {_input_example(config.dataset)} --out sets.parquet"
          f"{' --trust-code' * is_factory(config.resolved_model())}")
    warning = chance_line(predictor)
    if warning is not None:
        print(warning, file=sys.stderr)
    return 0


def _claim_run_dir(out: Path, config: TrainConfig, parser: argparse.ArgumentParser) -> None:
    """``train --out``: a new directory records the run's configuration and its data
    (``settings.json``); one that holds a run of other options, or of data that changed since, is
    refused in one line naming them, exit 2 -- it would resume another run, or answer for old data."""
    import json

    from dpsm_ray.cards import data_change, data_record
    from dpsm_ray.storage.layout import read_run_settings, write_run_settings

    mine = json.loads(json.dumps(config.to_dict(), default=list))
    try:
        stored = read_run_settings(out)
    except ValueError as error:  # CorruptFileError
        parser.exit(2, f"{parser.prog}: error: --out {out}: {error}; choose another --out, or remove it\n")
    if stored is None:
        write_run_settings(out, mine, data_record(config.dataset))
        return
    theirs = TrainConfig.from_dict(stored["config"])
    if theirs.config_hash() != config.config_hash():
        relevant = {k for k in mine if stored["config"].get(k) != mine[k]}
        differ = [f"{_flag_for(k)} {stored['config'].get(k)!r} there, {mine[k]!r} here" for k in sorted(relevant)]
        parser.exit(2, f"{parser.prog}: error: --out {out} holds a run started with other options ({'; '.join(differ)}); give those "
                       f"options to continue or show it, or another --out for this run (or remove {out})\n")
    change = data_change(stored.get("data"), config.dataset)
    if change is not None:
        parser.exit(2, f"{parser.prog}: error: --out {out} holds a run of other data than {config.dataset} holds now -- {change}; "
                       f"give another --out for the data as it is (or remove {out})\n")


def _input_example(dataset: str) -> str:
    """What ``predict --input`` takes for a model trained on ``dataset``, as an example."""
    if dataset.startswith("folder:"):
        return "FOLDER_OF_IMAGES"
    if dataset.startswith("table:"):
        return "NEW_ROWS.csv"
    return "X.npy"


def _cmd_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dpsm_ray.predict.predictor import INFO_FILE
    from dpsm_ray.storage.layout import SWEEP_FILE

    source = Path(args.source)
    sweep, predictor = (source / SWEEP_FILE).is_file(), (source / INFO_FILE).is_file()
    problem = None
    if not sweep and not predictor:
        problem = (f"{source} is neither a sweep's results directory (no sweep.json) nor a predictor directory (no predictor.json); "
                   f"a run's --out holds its predictor in {PREDICTOR_DIR}/")
    elif sweep and args.method is None:
        problem = f"{source} is a sweep's results directory: --method names the method whose final model to export"
    elif predictor and (args.method is not None or args.seed is not None):
        problem = f"{source} is a predictor directory: --method and --seed choose among a sweep's final models"
    elif predictor and args.format == "predictor":
        problem = f"{source} is a predictor already: --format torchscript or onnx exports it to run without dpsm_ray"
    elif args.format == "predictor" and (args.score is not None or args.calibration is not None):
        problem = "--score and --calibration choose the sets of --format torchscript or onnx; a predictor directory holds them all"
    if problem is not None:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    try:
        if args.format == "predictor":
            from dpsm_ray.predict.export import export_chosen

            export_chosen(source, args.method, args.out, seed=args.seed, overwrite=args.overwrite)
        else:
            from dpsm_ray.predict.portable import export_source

            export_source(source, args.out, args.format, method=args.method, seed=args.seed, score=args.score,
                          calibration=args.calibration, overwrite=args.overwrite, trust_code=args.trust_code)
    except (ValueError, FileNotFoundError) as error:  # PredictorError, CorruptFileError and UnreadableResults are ValueErrors
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


def _cmd_predict(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dpsm_ray.conformal import CALIBRATION_TITLES
    from dpsm_ray.predict.inputs import open_inputs
    from dpsm_ray.predict.predictions import output_format, write_sets
    from dpsm_ray.predict.predictor import Predictor

    try:
        form = output_format(args.out, args.format)
        predictor = Predictor.load(args.predictor, device=args.device, trust_code=args.trust_code)
        # an uncalibrated predictor, or one without what --calibration or --p-values need, fails before any input is read
        calibration = predictor.check_request(args.score, args.calibration, args.p_values)
        source = open_inputs(args.input, predictor.input_spec, label_column=predictor.label_column, feature_names=predictor.feature_names,
                             class_names=predictor.class_names, num_classes=predictor.num_classes, skip_unreadable=args.skip_unreadable)
        names = predictor.feature_names
        if names is not None and Path(args.input).suffix.lower() in (".npy", ".npz"):
            print(f"note: {args.input} is an array: its columns are read by position as this predictor's {len(names)} named features "
                  f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}); a .csv or .parquet of named columns is read by name",
                  file=sys.stderr)
        rows = write_sets(predictor, source, args.out, score=args.score, probabilities=args.probabilities, batch_size=args.batch_size,
                          non_empty=args.non_empty, format=form, calibration=calibration, p_values=args.p_values)
    except ValueError as error:  # PredictorError, InputError, InputFileError
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if source.skipped:
        print(f"skipped {len(source.skipped)} files that are not readable images (--skip-unreadable; e.g. {source.skipped[0]})",
              file=sys.stderr)
    if calibration == "risk":
        risk = predictor.info["risk"]
        lam = predictor.set_thresholds(args.score, "risk")[0][0].item()
        how = f"risk-controlled: lambda {lam:.4f}, expected miss cost <= {risk['level']:g}"
    elif calibration != "marginal":
        title = CALIBRATION_TITLES[calibration]
        thresholds, _ = predictor.set_thresholds(args.score, calibration)
        finite = thresholds[thresholds.isfinite()]
        short = predictor.fallback_classes(args.score) if calibration in ("class", "rc3p") else []
        if short:
            named = ", ".join(f"{k} ({predictor.class_names[k]!r})" if predictor.class_names else str(k) for k in short[:20])
            print(f"warning: {len(short)} class{'es' if len(short) > 1 else ''} had too few calibration points for a finite threshold at "
                  f"alpha={predictor.alpha:g} -- {named}{', ...' if len(short) > 20 else ''}: every {title} set holds them",
                  file=sys.stderr)
        how = (f"{title}: q {float(finite.min()):.4f} .. {float(finite.max()):.4f} over {len(finite)} classes" if len(finite)
               else f"{title}: every class threshold infinite")
    else:
        how = f"q {predictor.threshold(args.score):.4f}"
    sizes = rows["set_size"]
    mean_size = sum(sizes) / max(1, len(sizes))
    print(
        f"{len(sizes)} inputs, {args.score.upper()} sets at alpha={predictor.alpha:g} ({how}): mean set"
        f" size {mean_size:.2f}, {sum(1 for n in sizes if n == 0)} empty{', with p-values' if args.p_values else ''}; written to {args.out}"
    )
    if "covered" in rows and sizes:
        covered = sum(rows["covered"]) / len(sizes)
        print(f"labelled inputs: coverage {covered:.3f} (target {1 - predictor.alpha:g}), mean set size {mean_size:.2f}, accuracy "
              f"{sum(t == y for t, y in zip(rows['top1'], rows['label'])) / len(sizes):.3f}; each row's label and whether its set holds it "
              "are in the file")
    return 0


def _cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dpsm_ray.predict.predictor import Predictor
    from dpsm_ray.predict.serving import check_port, serve_predictor, serve_token

    if args.no_token and args.token_file:
        parser.exit(2, f"{parser.prog}: error: --no-token and --token-file exclude each other\n")
    if not 0 <= args.batch_wait_ms <= 1000:
        parser.exit(2, f"{parser.prog}: error: --batch-wait-ms must be between 0 and 1000; got {args.batch_wait_ms:g}\n")
    try:  # a bad directory, a taken port or an unusable token file fails here, in one line, before Ray starts
        Predictor.load(args.predictor, device="cpu", trust_code=args.trust_code)
        check_port(args.host, args.port)
        token, token_file = serve_token(args.host, args.token_file, args.no_token)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    served = ("host", "port", "replicas", "device", "cpus_per_replica", "max_batch", "address", "trust_code", "batch_rows",
              "batch_wait_ms", "max_ongoing", "torch_threads")
    serve_predictor(Path(args.predictor).resolve(), token=token, token_file=token_file, **{key: getattr(args, key) for key in served})
    return 0


def _cmd_calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dpsm_ray.cards import check_data_present, check_dataset, check_model, is_factory, score_names
    from dpsm_ray.predict.export import calibrate_weights, chance_line
    from dpsm_ray.predict.predictor import PredictorError

    try:  # bad options fail here, in one line, before anything is read
        if not 0 < args.alpha < 1:
            raise ValueError(f"--alpha {args.alpha:g}: must be in the open interval (0, 1)")
        check_dataset(args.dataset)
        check_model(args.model)
        check_data_present(args.dataset, args.data_root, False)
        out = Path(args.out)
        if (out / "predictor.json").exists() and not args.overwrite:
            raise PredictorError(f"--out {out} holds a predictor already; choose another directory, or --overwrite it")
        warnings = []
        predictor = calibrate_weights(args.weights, args.model, args.dataset, split=args.split, alpha=args.alpha, seed=args.seed,
                                      data_root=args.data_root, precision=args.precision, device=args.device, prepare=args.prepare,
                                      warn=warnings.append)
        predictor.save(out, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as error:  # ConfigError, PredictorError and the weights' errors are ValueErrors
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    calibration = predictor.info["calibration"]
    print(f"inputs: {_PREPARED_LINES[args.prepare]}")
    print(f"calibrated on {calibration['data']} at alpha={predictor.alpha:g} (accuracy there {calibration['accuracy']:.3f}): "
          + ", ".join(f"{kind.upper()} q {q:.4f}" for kind, q in predictor.thresholds.items() if kind in score_names()))
    test = predictor.info["test"]
    if test is not None:
        measured = ", ".join(
            f"{kind.upper()} coverage {m['coverage']:.3f} set size {m['set_size']:.2f}" for kind, m in test["scores"].items()
        )
        print(f"on {test['data']}: accuracy {test['accuracy']:.3f}; {measured}")
    trust = " --trust-code" if is_factory(args.model) else ""
    example = _input_example(args.dataset)
    print(f"predictor written to {out}; use it with dpsm-ray predict {out} --input {example} --out sets.parquet{trust}")
    for warning in [*warnings, chance_line(predictor)]:
        if warning is not None:
            print(warning, file=sys.stderr)
    return 0


_PREPARED_LINES = {
    "none": "passed to the model as they are (--prepare none: as MAPIE and TorchCP pass them); a model dpsm-ray trained takes them "
            "as the dataset's card prepares them (--prepare card)",
    "card": "standardised as the dataset's card prepares them for every model dpsm-ray trains, (x / divisor - mean) / std with the "
            "dataset's statistics (--prepare card; predictor.json's input); --prepare none passes them as they are",
}


def _cmd_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from dpsm_ray.sweep.cli import GENERIC_DEFAULTS, main as sweep_main
    from dpsm_ray.sweep.options import GENERIC

    return sweep_main(GENERIC, _SWEEP_DESCRIPTION, GENERIC_DEFAULTS, args.arguments)


def _cmd_report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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


_SWEEP_DESCRIPTION = (
    "A sweep of any dataset and methods: the CE base model, each method's Optuna search on validation data under the coverage "
    "constraint, each pick re-trained with --final-seeds seeds, the report and the predictors; the options of the sweep scripts "
    "(sweeps/*.py), at the service's defaults. --config FILE.yaml (or a sweep's RESULTS/sweep.json) sets any of them."
)
_TRUST_CODE_HELP = (
    "load a predictor whose model is a researcher's own factory (PKG.MODULE:FACTORY): importing it runs that code; only for predictors you"
    " trust"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpsm-ray", description="Conformal classifier training (DPSM, ConfTr, CUT, CE) on Ray.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_command(commands)
    _add_sweep_command(commands)
    _add_report_command(commands)
    _add_export_command(commands)
    _add_calibrate_command(commands)
    _add_predict_command(commands)
    _add_serve_command(commands)
    return parser


def _command(commands, name: str, handler, *, trust_code: bool = False, **texts):
    """A subcommand's parser (``help``, ``description``): no abbreviated options, run by ``handler``;
    ``trust_code`` offers --trust-code (a predictor whose model is a factory's code)."""
    command = commands.add_parser(name, allow_abbrev=False, **texts)
    command.set_defaults(handler=handler, parser=command)
    if trust_code:
        command.add_argument("--trust-code", action="store_true", help=_TRUST_CODE_HELP)
    return command


def _add_train_command(commands) -> None:
    """``dpsm-ray train``: every TrainConfig field, the preset, where its workers run, --out."""
    train = _command(
        commands,
        "train",
        _cmd_train,
        help="train and evaluate one model",
        description="Train one model with the chosen objective, print a progress line per epoch and a final table.",
    )
    add_config_options(train)
    train.add_argument("--preset", choices=PRESET_NAMES, help="official: train the method as its official code does (DPSM's: "
                       "T 1, lambda 0.05, q step 0.01, CE on the whole batch, each batch split in place, 40 epochs from the CE base "
                       "model with the lr restarted at 0.1 and divided by 10 at epoch 25; ConfTr as published: Stutz et al.'s "
                       "Fashion-MNIST settings); options given here override it (docs/method.md)")
    train.add_argument("--resource-timeout", type=_positive_seconds, default=DEFAULT_RESOURCE_TIMEOUT_S, metavar="SECONDS",
                       help="with --workers on a Ray cluster: how long to wait for the CPUs/GPUs the workers ask for before giving up "
                       "(an embedded Ray fails at once; default: %(default)s)")
    train.add_argument("--out", help="write config.json, splits.json, epochs.parquet, evals.parquet, classes.parquet, a checkpoint and the "
                       "trained model as a conformal predictor (predictor/) here; running again with the same directory resumes from the "
                       "checkpoint. Without it nothing is saved")


def _add_sweep_command(commands) -> None:
    """``dpsm-ray sweep``: listed here; its options are its own parser's (``dpsm_ray.sweep.cli``)."""
    sweep = commands.add_parser(
        "sweep",
        allow_abbrev=False,
        add_help=False,  # its own parser's --help (dpsm-ray sweep --help) lists every option
        help="search each method with Ray Tune + Optuna and re-train its pick: any dataset, from options or a config file",
        description=_SWEEP_DESCRIPTION,
    )
    sweep.add_argument("arguments", nargs=argparse.REMAINDER, help="the options (dpsm-ray sweep --help), or --config FILE.yaml")


def _add_report_command(commands) -> None:
    """``dpsm-ray report DIR``."""
    report = _command(
        commands,
        "report",
        _cmd_report,
        help="print the paper-style tables of a sweep or run and write report.md, report.tex and figures",
        description="Read DIR's Parquet files (a sweep's --results-dir or a run's --out); print the set-size table (mean ± std per "
        "method and score; DPSM against the best baseline and the CE base model as a per-seed paired change with a 95% interval) "
        "and all metrics; write DIR/report.md, DIR/report.tex (booktabs) with the chosen configurations, the sweep's settings and "
        "versions, and DIR/figures/*.png and *.pdf (coverage and set-size box plots, losses and their gaps, |q - Q_n|, training "
        "against validation set size, class-conditional coverage; each Optuna search's history and parameter importance).",
    )
    report.add_argument("directory", metavar="DIR", help="a sweep's results directory or a training run's --out directory")


def _add_export_command(commands) -> None:
    """``dpsm-ray export SOURCE [--method M] --out DIR [--format predictor|torchscript|onnx]``."""
    from dpsm_ray.conformal import SET_RULES
    from dpsm_ray.predict.portable import MODEL_FILES

    export = _command(
        commands,
        "export",
        _cmd_export,
        trust_code=True,
        help="copy a sweep's final model of a method out as a conformal predictor, or export a predictor to run without dpsm_ray",
        description="Copy the predictor of METHOD out of a sweep's RESULTS/predictors/ into OUT (docs/predictor.md): by default the final "
        "model chosen on validation data alone (the smallest validation set size among the method's seeds whose validation coverage "
        "reaches the sweep's floor), or --seed S's. Builds RESULTS/predictors/ first for a sweep finished without it. With --format "
        "torchscript or onnx, OUT holds instead one score's sets under one calibration for torch alone, or onnxruntime and numpy: the "
        "network with its input preparation (model.pt or model.onnx: raw inputs in, scores and ranks out), thresholds.json and LOAD.md, "
        "the loader; SOURCE may then be a predictor directory too.",
    )
    export.add_argument("source", metavar="SOURCE",
                        help="a sweep's --results-dir (with --method), or, with --format torchscript or onnx, a predictor directory")
    export.add_argument(
        "--method", help=f"the method whose final model to export: one the sweep ran ({', '.join((*METHODS, BASE_MODEL))})"
    )
    export.add_argument("--seed", type=int, help="that final seed's model instead of the chosen one")
    export.add_argument("--out", required=True, metavar="DIR", help="the directory to write (predictor.json and weights.pt; with "
                        "--format torchscript or onnx the model file, thresholds.json and LOAD.md)")
    export.add_argument("--format", default="predictor", choices=("predictor", *MODEL_FILES),
                        help="predictor: a predictor directory, for dpsm_ray's predict and serve; torchscript (model.pt) or onnx "
                        "(model.onnx, needs pip install \"dpsm_ray[onnx]\"): one score's sets that run without dpsm_ray "
                        "(default: %(default)s)")
    export.add_argument("--score", choices=score_names(), help="the exported sets' non-conformity score (default: hps)")
    export.add_argument("--calibration", choices=SET_RULES,
                        help="the exported sets' calibration (docs/predictor.md) (default: the predictor's own)")
    export.add_argument("--overwrite", action="store_true", help="replace a predictor, or an export, already in --out")


def _add_calibrate_command(commands) -> None:
    """``dpsm-ray calibrate``: a model trained elsewhere, its weights and labelled data."""
    calibrate = _command(
        commands,
        "calibrate",
        _cmd_calibrate,
        help="make a predictor of a model trained elsewhere: its weights file and labelled calibration data",
        description="Build MODEL, load its weights from WEIGHTS (a state dict: .pt/.pth read with torch.load(weights_only=True), or "
        ".safetensors), calibrate every score on --split of --dataset (labelled points the model never trained on) and write a predictor "
        "into --out: the files export writes, for predict and serve. The model takes the raw inputs as they are (--prepare none), or "
        "as the dataset's card prepares them (--prepare card, as every model dpsm-ray trains does); with --split other than all and "
        "test, the test split measures coverage, set size and accuracy (docs/predictor.md).",
    )
    calibrate.add_argument("--model", required=True, help=f"what builds the network: {model_choices()}")
    calibrate.add_argument("--weights", required=True, metavar="FILE", help="its trained weights (.pt, .pth, .safetensors)")
    calibrate.add_argument("--dataset", required=True, metavar="SPEC",
                           help="the labelled data, as --dataset of train (e.g. table:cal.csv:label=y)")
    calibrate.add_argument("--split", default="cal", choices=("cal", "val", "test", "train", "all"),
                           help="the split that calibrates: the dataset's calibration split at --seed, or all of it (e.g. a file of "
                           "calibration points only; no test metrics then) (default: %(default)s)")
    calibrate.add_argument("--alpha", type=float, default=0.1, help="the sets' miscoverage level (default: %(default)s)")
    calibrate.add_argument("--seed", type=int, default=0,
                           help="draws the dataset's splits and the APS/RAPS uniforms (default: %(default)s)")
    calibrate.add_argument("--data-root", help="where the dataset's files are (built-in datasets; the dataset's default otherwise)")
    calibrate.add_argument("--prepare", default="none", choices=("none", "card"),
                           help="what the model takes: none, the raw inputs as they are (a model trained in plain PyTorch on the data's "
                           "values; MAPIE and TorchCP pass inputs so); card, inputs standardised as the dataset's card prepares them for "
                           "every model dpsm-ray trains (dpsm_ray.cards.load_splits gives them). A model whose accuracy is far higher "
                           "the other way is warned of (default: %(default)s)")
    calibrate.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                           help="the forward passes' precision (default: %(default)s)")
    calibrate.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:N (default: %(default)s)")
    calibrate.add_argument("--out", required=True, metavar="DIR", help="the predictor directory to write")
    calibrate.add_argument("--overwrite", action="store_true", help="replace a predictor already in --out")


def _add_predict_command(commands) -> None:
    """``dpsm-ray predict PREDICTOR --input PATH --out FILE``."""
    from dpsm_ray.conformal import SET_RULES

    predict = _command(
        commands,
        "predict",
        _cmd_predict,
        trust_code=True,
        help="prediction sets of new inputs from a predictor, as Parquet, CSV or JSON",
        description=(
            "Read inputs -- an .npy or .npz array [n, *shape] (or [n, features]), a folder of image files (resized and normalised as the "
            "predictor says), or a Parquet or CSV table of feature columns (read by name for a predictor trained on a table) -- and write "
            "one row per input: input_id, set (list<int32>), set_names (where the classes have names), set_size, top1 (and top1_name), "
            "with --probabilities the softmax row, with --p-values a p_value_K column per class K; labelled inputs (a table's label "
            "column, an .npz's y) add label and covered, and the coverage is printed."
        ),
    )
    predict.add_argument(
        "predictor",
        metavar="PREDICTOR",
        help="a predictor directory (dpsm-ray export --out, RESULTS/predictors/NAME, a run's --out/predictor)",
    )
    predict.add_argument(
        "--input",
        required=True,
        metavar="PATH",
        help=(
            ".npy, .npz (array 'x', optional integer 'ids' and labels 'y'), .parquet or .csv (one column per feature, by name where the "
            "predictor has feature names, else in order; optional 'id'; the training table's label column is read as labels), an "
            "image, or a folder of images"
        ),
    )
    predict.add_argument("--out", required=True, metavar="FILE", help="the file to write, e.g. sets.parquet (its format from the suffix: "
                         ".parquet, .csv, .json, .jsonl; or --format)")
    predict.add_argument("--format", choices=("parquet", "csv", "json", "jsonl"),
                         help="the output's format (default: from --out's suffix); csv and jsonl hold the rows only, a list as JSON text "
                         "in a CSV cell; json is {\"dpsm_ray\": what the sets are, \"rows\": [...]}")
    predict.add_argument("--score", default="hps", choices=score_names(), help="non-conformity score (default: %(default)s)")
    predict.add_argument(
        "--calibration",
        choices=SET_RULES,
        help="marginal: one threshold per score, 1 - alpha coverage on average; class: a threshold per class, 1 - alpha coverage in every "
        "class (usually larger sets; a class with too few calibration points is in every set); cluster: a threshold per cluster of alike "
        "classes (Ding et al. 2023); rc3p: a threshold and a limit on the label's rank per class (Shi et al. 2024); risk: the expected "
        "class-weighted miss cost at most its level (conformal risk control, a predictor from Predictor.control_risk) (default: the "
        "predictor's own, recalibrate's by=)",
    )
    predict.add_argument("--probabilities", action="store_true", help="add each input's softmax row (list<double>)")
    predict.add_argument(
        "--p-values",
        action="store_true",
        help="add a p_value_K column per class K: its conformal p-value, against the same calibration; the set at any alpha is the "
        "classes whose p-value exceeds it (at the predictor's alpha, the set column, unless --non-empty filled it)",
    )
    predict.add_argument(
        "--non-empty",
        action="store_true",
        help="put the top class into every empty set (conservative: coverage only rises; docs/predictor.md)",
    )
    predict.add_argument("--skip-unreadable", action="store_true",
                         help="a folder of images: leave out (and count) the files that are not readable images, as training's "
                         "folder:PATH:skip=1 does; without it such a file is refused, naming it")
    predict.add_argument("--batch-size", type=_positive_int, default=512, help="inputs per forward pass (default: %(default)s)")
    predict.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:N (default: %(default)s)")


def _add_serve_command(commands) -> None:
    """``dpsm-ray serve PREDICTOR``."""
    serve = _command(
        commands,
        "serve",
        _cmd_serve,
        trust_code=True,
        help="serve a predictor over HTTP on Ray Serve",
        description="Serve PREDICTOR on Ray Serve: POST /predict with {\"inputs\": [...]} returns each input's prediction set; GET /health "
        "describes the predictor. Bad requests get a 4xx status and {\"error\": ...}. Runs until Ctrl-C (or SIGTERM), then stops every "
        "process it started.",
    )
    serve.add_argument("predictor", metavar="PREDICTOR", help="a predictor directory")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s; 0.0.0.0 opens it to the network, behind a bearer token: --token-file)",
    )
    serve.add_argument("--port", type=_port_number, default=8000, help="HTTP port (default: %(default)s)")
    serve.add_argument("--replicas", type=_positive_int, default=1, help="model replicas (default: %(default)s)")
    serve.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica (default: %(default)s)")
    serve.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: the replicas share the GPU when there is one (default: %(default)s)",
    )
    serve.add_argument(
        "--token-file",
        metavar="FILE",
        help=(
            "the bearer token every request but GET /health must carry: read from FILE (readable by its owner only), "
            "or generated into it; default, when --host is not a loopback address: $DPSM_RAY_CACHE/serve-token"
        ),
    )
    serve.add_argument(
        "--no-token", action="store_true", help="serve beyond this machine without a token: anyone who can reach it can query the model"
    )
    serve.add_argument(
        "--max-batch", type=_positive_int, default=4096, help="most inputs in one request; more get status 413 (default: %(default)s)"
    )
    # the four below measured with bench/serve_load.py on 2 cores (docs/predictor.md)
    serve.add_argument(
        "--max-ongoing",
        type=_positive_int,
        default=1024,
        help="requests a replica holds at once, their inputs batched (default: %(default)s); beyond it Serve's router retries with "
        "back-off and throughput collapses (its own default, 5: 12 requests/s with 32 clients, against ~200)",
    )
    serve.add_argument(
        "--batch-rows", type=_positive_int, default=512,
        help="most inputs of concurrent requests in one forward pass (default: %(default)s)",
    )
    serve.add_argument(
        "--batch-wait-ms",
        type=float,
        default=2.0,
        help="how long a request that finds no forward pass running waits for others to share its pass (while they hold fewer than "
        "--batch-rows inputs); the requests that arrive during a pass share the next one at once (default: %(default)s)",
    )
    serve.add_argument(
        "--torch-threads",
        type=_positive_int,
        help="torch threads in each replica (default: --cpus-per-replica, at least 1: more would fight the server's own processes)",
    )
    serve.add_argument(
        "--address",
        help=(
            "a Ray cluster to run on (default: $RAY_ADDRESS, else one started on this machine with `ray start`, else a Ray instance of its"
            " own)"
        ),
    )


def main(argv: list[str] | None = None) -> int:
    from dpsm_ray.sweep.options import parse_strictly

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:  # its own parser takes every option after it (argparse would claim --help and unknown ones first)
        return _cmd_sweep(argparse.Namespace(arguments=argv[1:]), None)
    parser = build_parser()
    args = parse_strictly(parser, argv)
    skip_final_collection()
    try:
        return args.handler(args, args.parser)
    except KeyboardInterrupt:  # wherever else Ctrl-C lands (importing, starting or stopping Ray)
        args.parser.exit(3, f"{args.parser.prog}: interrupted\n")


if __name__ == "__main__":
    sys.exit(main())
