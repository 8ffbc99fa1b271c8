"""The command line of the ``sweeps/*.py`` scripts.  Each script passes its own defaults; every
option is validated before Ray starts, and errors name the option, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from dpsm_ray.cards import default_model, model_card, model_cards
from dpsm_ray.cards import PAPER_METHODS
from dpsm_ray.sweep.options import GENERIC, check_storage, parse_tracking, parse_with_config, version_line
from dpsm_ray.sweep.space import DEFAULT_RANGES, PAPER_GRID, knob_name, parse_range
from dpsm_ray.sweep.spec import OPTUNA_STORAGE_ENV, SAMPLERS, SCHEDULERS
from dpsm_ray.timing import skip_final_collection
from dpsm_ray.config import ConfigError, TrainConfig, add_config_options, field_type, fields_marked
from dpsm_ray.train.presets import PRESET_NAMES
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S


def config_options() -> dict:
    """The training options a sweep script offers (the rest are the script's choice): the fields
    and method options marked ``sweep`` (dpsm_ray/config.py, the cards'), with argparse's type for each."""
    return {name: {"float": float, "int": int, "str": str, "bool": bool}[field_type(name)] for name in fields_marked("sweep")}


def trials_per_gpu(model: str) -> int:
    """The default packing factor: trials sharing one GPU for ``model`` (its card's)."""
    return model_card(model).trials_per_gpu


def _packing_help() -> str:
    """Each model's default packing, grouped: "4 for mlp, ...; 1 for resnet50, densenet121"."""
    groups: dict[int, list[str]] = {}
    for card in model_cards():
        groups.setdefault(card.trials_per_gpu, []).append(f"{card.name}:{card.argument}" if card.argument else card.name)
    groups.setdefault(1, []).append("PKG.MODULE:FACTORY")
    return "; ".join(f"{count} for {', '.join(names)}" for count, names in sorted(groups.items(), reverse=True))


def _packed_gpus_per_worker(values: dict, explicit: bool, packing: str) -> float:
    """GPUs each trial's worker asks Ray for: the script's or user's ``gpus_per_worker`` when
    explicit, else a whole GPU divided by the packing factor (``auto`` or a number), for
    single-worker GPU trials."""
    if packing != "auto":
        try:
            factor = int(packing)
        except ValueError:
            factor = 0
        if factor < 1:
            raise ValueError(f"--trials-per-gpu must be auto or an integer >= 1; got {packing!r}")
    gpus = values.get("gpus_per_worker", 0)
    if explicit or not gpus or values.get("workers", 0) > 1:
        return gpus
    if packing == "auto":
        model = values.get("model", "auto")
        factor = trials_per_gpu(default_model(values["dataset"]) if model == "auto" else model)
    return 1 / factor


def _parse_axis_values(text: str, option: str) -> tuple[str, tuple]:
    """``lr=0.01,0.1`` or ``milestones=25+40,3`` -> ("lr", (0.01, 0.1)) / ("milestones", ((25, 40), (3,)))."""
    axis, _, values = text.partition("=")
    axis = knob_name(axis, f"{option} {text}")
    if axis not in PAPER_GRID:
        raise ValueError(f"{option}: unknown grid axis {axis!r}; allowed: {', '.join(PAPER_GRID)}")
    try:
        parsed = tuple(
            tuple(int(m) for m in v.split("+")) if axis == "milestones" else (int(v) if axis in ("batch_size", "epochs") else float(v))
            for v in values.split(",")
        )
    except ValueError:
        raise ValueError(f"{option} {text!r}: values must be numbers (milestones as 25+40)") from None
    return axis, parsed


# ``dpsm-ray sweep``: a sweep of any dataset and methods, from options or a config file, at the
# service's defaults (the sweep scripts in sweeps/ are the same command with their own)
GENERIC_DEFAULTS = {"trials": 8, "final_seeds": 3, "config": {}}


def build_parser(name: str, description: str, defaults: dict) -> argparse.ArgumentParser:
    prog = "dpsm-ray sweep" if name == GENERIC else f"sweeps/{name}.py"
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    _add_sweep_options(parser, name, defaults)
    _add_search_options(parser, defaults)
    add_running_options(parser, defaults)
    add_config_options(parser, fields_marked("sweep"), defaults["config"])
    return parser


def _add_sweep_options(parser: argparse.ArgumentParser, name: str, defaults: dict) -> None:
    """What the sweep is: its config file, directory, budget, methods, seeds and coverage slack."""
    add = parser.add_argument
    add("--version", action="version", version=version_line("dpsm_ray"))
    add(
        "--config",
        metavar="FILE",
        help=(
            "a .yaml or .json file of options (named as here, e.g. trials: 8); options given here override it; "
            "a sweep's RESULTS/sweep.json is one: --config RESULTS/sweep.json --results-dir NEW runs that sweep again"
        ),
    )
    add(
        "--results-dir",
        help=(
            f"directory of this sweep's Parquet files, report and Tune state (default: results/{name} for the script's own dataset and "
            f"methods; another dataset's name, then any other --methods, otherwise: e.g. results/fonts, results/table-cancer-ce-dpsm); "
            "on a multi-node cluster it must be on shared storage"
        ),
    )
    add("--trials", type=int, help=f"Optuna trials per method (default: {defaults['trials']})")
    add(
        "--trials-per-knob",
        type=int,
        metavar="N",
        help="N Optuna trials per knob of each method, in place of --trials, so that each search's budget follows what it explores "
        "(CE has 1 knob, CUT 2, ConfTr 3, DPSM 4: --trials-per-knob 4 gives them 4, 8, 12 and 16 trials)",
    )
    add("--min-trials", type=int, metavar="N", help="a floor on every method's search: at least N trials, whatever --trials or "
        "--trials-per-knob give it (a method with one knob gets N, not 2; bench/search_quality.py measures short searches)")
    add("--resume", action="store_true", help="continue the interrupted sweep in --results-dir without redoing finished trials")
    add(
        "--seed",
        type=int,
        default=0,
        help="sweep seed: data splits, base model, the search's sampler; final seeds are seed .. seed+S-1 (default: %(default)s)",
    )
    add("--methods", default=",".join(defaults.get("methods", PAPER_METHODS)), help="comma-separated methods (default: %(default)s)")
    add(
        "--final-seeds",
        type=int,
        default=defaults["final_seeds"],
        help="seeds the best configuration of each method is re-trained with (default: %(default)s)",
    )
    add(
        "--coverage-slack",
        type=float,
        default=defaults.get("coverage_slack", 0.0),
        help="a trial is feasible if validation coverage >= 1 - alpha - slack (default: %(default)s)",
    )


def _add_search_options(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """How each method is searched: Optuna's ranges, sampler and scheduler, or the paper's grid."""
    add = parser.add_argument
    add(
        "--range",
        action="append",
        default=[],
        metavar="KNOB=LOW:HIGH",
        help=f"search range of a knob ({', '.join(DEFAULT_RANGES)}), log-uniform; repeatable",
    )
    add("--grid", choices=["paper"], help="run the paper's exhaustive grid (its appendix D) instead of Optuna")
    add("--fix", action="append", default=[], metavar="AXIS=VALUE", help=f"paper grid: fix an axis ({', '.join(PAPER_GRID)}); repeatable")
    add("--subset", action="append", default=[], metavar="AXIS=V1,V2", help="paper grid: keep only these values of an axis; repeatable")
    add("--grid-budget", type=int, metavar="N", help="paper grid: a random N of its configurations, chosen by --seed (default: all)")
    add("--sampler", choices=SAMPLERS, default="sobol-tpe", help="how a search proposes: tpe (Optuna's TPE after 4 random trials), random, "
        "sobol (a scrambled Sobol sequence seeded by the sweep: trial n of every method draws the same lr), sobol-tpe (TPE after 4 of "
        "those Sobol points), gp (Optuna's GPSampler with "
        "the coverage constraint, after 4 random trials); bench/search_quality.py measures them (default: %(default)s)")
    add(
        "--scheduler",
        choices=SCHEDULERS,
        default=defaults.get("scheduler", "fifo"),
        help=(
            "fifo: every search trial runs to the end; asha: stop unpromising trials early on their validation set size (default:"
            " %(default)s)"
        ),
    )
    add(
        "--grace-period",
        type=int,
        default=defaults.get("grace_period", 5),
        metavar="EPOCHS",
        help="asha: epochs every trial runs before it may be stopped (default: %(default)s)",
    )
    add(
        "--reduction-factor", type=int, default=3, metavar="ETA", help="asha: one in ETA trials goes on at each rung (default: %(default)s)"
    )
    add("--optuna-storage", metavar="URL", default=os.environ.get(OPTUNA_STORAGE_ENV),
        help=f"SQLAlchemy URL of the Optuna studies, e.g. postgresql://user:PASSWORD@head/optuna; read from ${OPTUNA_STORAGE_ENV} when not "
        "given, and never written anywhere, so a resumed sweep needs it again (default: sqlite:///RESULTS/optuna.db)")


def add_running_options(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """Where and how the trials run: concurrency, the cluster, retries, tracking, logs, data, GPU packing."""
    add = parser.add_argument
    add("--concurrency", type=int, default=defaults.get("concurrency", 1), help="trials running at once (default: %(default)s)")
    add(
        "--group-size",
        type=int,
        default=defaults.get("group_size", 1),
        metavar="N",
        help=(
            "configurations one trial trains side by side in its process and its resources, each with its own seed, checkpoint and"
            " rows (on a GPU, each on a CUDA stream of its own): the paper grid without ASHA, the final stage, a study's arms; Optuna"
            " and ASHA trials keep 1. Rows are the same whatever N (docs/cluster.md; default: %(default)s)"
        ),
    )
    add(
        "--address",
        help=(
            "Ray cluster address (default: $RAY_ADDRESS, else a cluster started on this machine with `ray start`, else a Ray instance"
            " embedded in this process)"
        ),
    )
    add(
        "--resource-timeout",
        type=float,
        default=DEFAULT_RESOURCE_TIMEOUT_S,
        metavar="SECONDS",
        help=(
            "on a Ray cluster: how long to wait for the CPUs/GPUs one trial asks for before giving up (an embedded Ray fails at once;"
            " default: %(default)s)"
        ),
    )
    add(
        "--trial-retries",
        type=int,
        default=2,
        metavar="N",
        help=(
            "restarts of a trial from its last checkpoint after its process dies (a lost node); a trial that raises is retried too"
            " (default: %(default)s)"
        ),
    )
    add(
        "--tracking",
        metavar="mlflow[=URI]",
        help=(
            "log every trial as an MLflow run, one experiment per sweep (pip install -e '.[mlflow]'); "
            "URI: the tracking server, default $MLFLOW_TRACKING_URI, else sqlite:///RESULTS/mlflow.db (docs/tracking.md)"
        ),
    )
    add(
        "--process-per-trial",
        action="store_true",
        help=(
            "start a new process for every trial; by default a trial that trains in its own process hands it to the next trial of its Tune"
            " experiment (all the searches are one, the final stage another), saving the start-up and imports (seconds a trial;"
            " bench/sweep_overhead.py)"
        ),
    )
    add(
        "--worker-logs",
        action="store_true",
        help=(
            "show the trials' own output (epoch lines, Ray's) here; by default it stays in Ray's session logs and one line per trial is"
            " printed"
        ),
    )
    add("--download", action="store_true", help="download the dataset into --data-root if it is missing")
    add(
        "--preset",
        choices=PRESET_NAMES,
        help=(
            "official: each method's objective settings as its official code has them (DPSM's T 1, lambda 0.05, q step 0.01, CE on the"
            " whole batch, each batch split in place; docs/method.md), under what the search sets; the schedule stays the script's"
        ),
    )
    add(
        "--trials-per-gpu",
        default="auto",
        metavar="N|auto",
        help="single-worker GPU trials packed on one GPU (each asks for 1/N of it); auto: the model card's ("
        + _packing_help()
        + "); --gpus-per-worker overrides (default: %(default)s)",
    )


# SweepSpec's fields that its options give as they are parsed, under the same name
_PASSED_ON = ("trials_per_knob", "min_trials", "final_seeds", "coverage_slack", "grid_budget", "sampler", "scheduler", "grace_period",
              "reduction_factor", "optuna_storage", "concurrency", "seed", "preset", "address", "resource_timeout", "trial_retries",
              "worker_logs", "tracking", "process_per_trial", "group_size")


def spec_from_args(name: str, args: argparse.Namespace, defaults: dict):
    """The ``SweepSpec`` the options describe (raises ConfigError / ValueError on bad values)."""
    from dpsm_ray.sweep.spec import SweepSpec

    # base_fields: training settings a --config file sets beyond the options (a sweep.json's base)
    offered = config_options()
    values = {**defaults["config"], **getattr(args, "base_fields", {}), **{k: v for k, v in vars(args).items() if k in offered}}
    values.update(seed=args.seed, download=args.download)
    values["gpus_per_worker"] = _packed_gpus_per_worker(values, "gpus_per_worker" in vars(args), args.trials_per_gpu)
    base = TrainConfig.from_dict(values)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    ranges = tuple(parse_range(text) for text in args.range)
    fixed = {}
    for text in args.fix:
        axis, parsed = _parse_axis_values(text, "--fix")
        if len(parsed) != 1:
            raise ValueError(f"--fix {text!r}: give exactly one value (use --subset for several)")
        fixed[axis] = parsed[0]
    subsets = dict(_parse_axis_values(text, "--subset") for text in args.subset)
    if (fixed or subsets or args.grid_budget is not None) and not args.grid:
        raise ValueError("--fix/--subset/--grid-budget apply to --grid paper")
    workers = base.workers
    resources = {"cpu": base.cpus_per_worker, "gpu": base.gpus_per_worker} if workers == 0 else {"cpu": 0.1}
    passed = {key: getattr(args, key) for key in _PASSED_ON}
    return SweepSpec(name=getattr(args, "sweep_name", None) or name, base=base, methods=methods, ranges=ranges,
                     trials=defaults["trials"] if args.trials is None else args.trials, grid=args.grid == "paper",
                     grid_fixed=tuple(fixed.items()), grid_subsets=tuple(subsets.items()),
                     trial_resources=tuple((k, v) for k, v in resources.items() if v), **passed)


def main(name: str, description: str, defaults: dict, argv: list[str] | None = None) -> int:
    """Parse, validate, run the sweep, print the table.  Exit status (``dpsm_ray.sweep.exits``): 0
    when the sweep finished (or had finished before: its table is printed again), 2 on bad input,
    3 when it stopped before the end and ``--resume`` continues it -- Ctrl-C included, wherever it
    lands."""
    from dpsm_ray.sweep.exits import exit_codes

    parser = build_parser(name, description, defaults)
    args = parse_with_config(parser, name, config_options(), argv)
    skip_final_collection()
    with exit_codes(parser, where=lambda: Path(args.results_dir).resolve() if args.results_dir else None):
        return run(name, parser, args, defaults)


def run(name: str, parser: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict) -> int:
    try:
        check_storage(vars(args))
        parse_tracking(args.tracking)
        spec = spec_from_args(name, args, defaults)
    except ConfigError:
        raise
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    from dpsm_ray.sweep.progress import Progress
    from dpsm_ray.sweep.driver import run_sweep
    from dpsm_ray.sweep.spec import SweepFinished
    from dpsm_ray.train.ray_session import leaving_ray_as_it_was

    if args.results_dir is None:
        args.results_dir = default_results_dir(spec.name, spec.base.dataset, spec.methods, defaults)
    started = time.perf_counter()
    with leaving_ray_as_it_was():
        try:
            results = run_sweep(spec, Path(args.results_dir), resume=args.resume, log=Progress(lambda line: print(line, flush=True)))
        except SweepFinished as error:  # the command run a second time: show what the first one made
            return _show_finished(Path(args.results_dir), str(error), parser.prog)
    print(f"sweep finished in {time.perf_counter() - started:.0f}s; results in {results}", file=sys.stdout)
    return 0


def default_results_dir(name: str, dataset: str, methods: tuple[str, ...], defaults: dict) -> str:
    """``results/NAME`` for the script's own dataset and methods; another dataset gives its own
    name (``results/fonts``, ``results/table-cancer``, ``results/folder-birds``), other methods
    their names after it (``results/digits-ce-dpsm``): the README's own-data lines never land in
    the quick start's directory.  (A directory holding other settings is refused anyway.)"""
    from dpsm_ray.own_data import split_path_spec

    stem = name
    if dataset != defaults["config"].get("dataset"):
        family, path, _ = split_path_spec(dataset)
        own = family in ("folder", "table")
        stem = f"{family}-{Path(path).stem}" if own else dataset.replace(":", "-").replace(",", "-").replace("=", "")
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", stem)
    if tuple(methods) != tuple(defaults.get("methods", PAPER_METHODS)):
        stem += "-" + "-".join(methods)
    return f"results/{stem}"


def _show_finished(results: Path, why: str, prog: str) -> int:
    """A finished sweep's headline tables, as its end printed them (from its Parquet files, nothing
    drawn or written), and how to run another."""
    from dpsm_ray.storage.layout import FINISHED_FILE
    from dpsm_ray.results.report import headline

    finished = json.loads((results / FINISHED_FILE).read_text())
    report = results / "report.md"
    print(headline(results))
    print(f"{prog}: {why} (finished {finished.get('finished_at', 'earlier')}); its main table is above, the whole report in {report}. "
          f"To run the sweep again, give a new --results-dir; `dpsm-ray report {results}` rebuilds the report and figures.")
    return 0
