"""The fidelity study: does a method, trained as the paper trained it, make smaller sets than CE?

A study runs fixed *arms* -- a method and its settings, no search -- each with every seed.  It is
a sweep (``study_spec``: ``SweepSpec.arms``), run by the one driver (``dpsm_ray.sweep.driver``):
one stage per arm in one Tune experiment (the first arm, then the others beside each other), the
ledger, the lock, ``sweep.json`` as its marker, resume, the cluster path.
Every arm that fine-tunes starts, for seed s, from seed s's CE base model (trained once, in the
first trial that needs it, and cached under ``RESULTS/base_models``); the ``base`` arm evaluates
those base models as they are -- the paper's CE column.  Every model is evaluated by the same
protocol (the calibration/test split of the study's seed, ``eval_splits`` re-splits, HPS, APS and
RAPS), and arms are compared per seed: the percent change of the mean set size against CE
fine-tuned and against the base model, with a Student t interval over the seeds -- the seeds are
the independent replicates, a model's re-splits are not.

Writes ``trials.parquet``, ``epochs.parquet``, ``evals.parquet`` and ``classes.parquet`` (the
``stage`` column names the arm), ``sweep.json`` (the settings a resume must match, its arms among
them) and ``fidelity.json`` / ``fidelity.md`` (the tables: ``dpsm_ray/results/studies.py``).  Here:
a study as a sweep, a search's picks as arms, and the studies' command line; the arms themselves are
data in the scripts that run them (``sweeps/decisive.py``, ``sweeps/fidelity.py``,
``sweeps/cifar100_fidelity.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dpsm_ray.config import TrainConfig
from dpsm_ray.storage.layout import SWEEP_FILE, CoverageFloor, Results
if TYPE_CHECKING:
    from dpsm_ray.sweep.spec import SweepSpec
from dpsm_ray.results.studies import (
    Arm,
    Study,
    analyse,
    analyse_tables,
    markdown_report,
    read_study_folders,
)


def study_spec(study: Study) -> SweepSpec:
    """``study`` as the sweep that runs it: its arms, over its common settings, with its seeds."""
    from dpsm_ray.sweep.spec import SweepSpec

    seeds = tuple(study.seeds)
    if seeds != tuple(range(seeds[0], seeds[0] + len(seeds))):
        raise ValueError(f"a study's seeds must be consecutive (seed .. seed + n - 1); got {list(seeds)}")
    return SweepSpec(
        name=study.name, base=study.common, methods=(), arms=study.arms, final_seeds=len(seeds), seed=seeds[0],
        concurrency=study.concurrency, trial_resources=study.trial_resources, address=study.address,
        resource_timeout=study.resource_timeout, trial_retries=study.trial_retries,
    )


def run_study(study: Study, results_dir: str | os.PathLike, *, resume: bool = False, log=print) -> dict:
    """Run (or, with ``resume``, continue -- adding arms, or running a subset) every arm of
    ``study`` into ``results_dir`` through the sweep driver (``dpsm_ray.sweep.driver``: a study is
    a sweep whose stages are its arms x seeds); returns the analysis.  A finished study asked again
    without ``resume`` raises ``SweepFinished``, as a sweep does."""
    from dpsm_ray.sweep.driver import run_sweep

    results = Path(results_dir).resolve()
    run_sweep(study_spec(study), results, resume=resume, log=log)
    return analyse(study, results)


def _report_study(study: Study, results_dir: str | os.PathLike, log=print) -> dict:
    """The analysis of the trials ``results_dir`` holds now -- its Parquet files, ``compact/`` and
    ``fidelity.md`` written from its ledger -- with nothing trained and no Ray started: a study
    stopped part way is reported as far as it got (each arm's model count says how far).
    SweepError if there is no such study there, or a driver holds it."""
    from dpsm_ray.sweep.driver import holding
    from dpsm_ray.sweep.spec import SweepError, settings_differences

    results = Path(results_dir).resolve()
    spec = study_spec(study)
    stored = Results(results).sweep
    if stored is None or not stored.get("arms"):
        raise SweepError(f"no study in {results} (no {SWEEP_FILE} naming arms)")
    with holding(results, study.common, log):
        if settings_differences(stored, spec.describe()):
            raise SweepError(f"the study in {results} was started with other settings; name the options it was run with")
        _write_study_results(study, results)
        return analyse(study, results)


def _write_study_results(study: Study, results: Path) -> None:
    from dpsm_ray.sweep.collect import write_results

    write_results(results, study.name, CoverageFloor(study.common.alpha), [(arm.name, arm.name) for arm in study.arms])


# ----------------------------------------------------------------------------- the arms


# the settings a sweep must share with the study for its picks to be the study's searched arms
SHARED_WITH_THE_SWEEP = (
    "dataset",
    "alpha",
    "model",
    "pretrained_path",
    "init",
    "base_epochs",
    "base_lr",
    "base_batch_size",
    "base_milestones",
    "epochs",
    "batch_size",
    "milestones",
    "lr_decay",
    "lr_schedule",
)


def searched_arms(sweep_dir: Path, common: TrainConfig, log=print, *, differing: tuple[str, ...] = ()) -> tuple[Arm, ...]:
    """``searched_<method>`` for each method the finished Optuna sweep in ``sweep_dir`` searched (in
    the cards' order): the method at the configuration its search picked (the sweep's own
    rule, dpsm_ray/sweep/pick.py), re-trained by the study with every seed from the study's base
    models.  SweepError if the sweep is not one the study can use: one whose settings differ from
    the study's in a field of SHARED_WITH_THE_SWEEP, but those named in ``differing`` (round three
    re-trains backbone 0's picks on backbone 1: ``("pretrained_path",)``)."""
    from dpsm_ray.cards import method_cards
    from dpsm_ray.sweep.pick import best_overrides
    from dpsm_ray.sweep.space import method_knobs
    from dpsm_ray.storage.layout import SWEEP_FILE
    from dpsm_ray.sweep.spec import SweepError, read_sweep_file, search_budget

    sweep_dir = Path(sweep_dir)
    if not (sweep_dir / SWEEP_FILE).is_file():
        raise SweepError(f"--searched-from {sweep_dir}: no sweep there (no sweep.json)")
    stored = read_sweep_file(sweep_dir)
    if stored.get("grid"):
        raise SweepError(f"--searched-from {sweep_dir}: a --grid sweep; the searched arms come from an Optuna search")
    ours = json.loads(json.dumps(common.to_dict(), default=list))
    for name in SHARED_WITH_THE_SWEEP:
        if stored["base"].get(name) != ours[name] and name not in differing:
            raise SweepError(
                f"--searched-from {sweep_dir}: its sweep ran with {name}={stored['base'].get(name)!r}, the study with {ours[name]!r}; "
                "search with the study's settings"
            )
    if not Results(sweep_dir).path("trials").is_file():
        raise SweepError(f"--searched-from {sweep_dir}: the sweep has no finished search trials yet (no trials.parquet)")
    arms = []
    searched = [card for card in method_cards() if card.name in stored.get("methods", ())]
    for card in searched:
        overrides = best_overrides(sweep_dir, card.name, method_knobs(card.name), log)
        if overrides is not None:
            budget = search_budget(stored["trials"], stored.get("trials_per_knob"), card.name, stored.get("min_trials"))  # what it gave
            title = f"{card.title}, searched ({budget} Optuna trials)"
            arms.append(Arm(f"searched_{card.name}", title, {"method": card.name, **overrides}))
    if not arms:
        names = ", ".join(card.name for card in searched)
        raise SweepError(f"--searched-from {sweep_dir}: none of {names} has a search trial that finished")
    return tuple(arms)


def keep_search_record(sweep_dir: str | None, out: Path) -> None:
    """With ``--searched-from``: the search's record beside the study's compact results
    (``compact/search.csv``, committed with them), so each searched arm's pick can be checked
    against every trial of its search without the sweep's folder."""
    if sweep_dir:
        from dpsm_ray.results.provenance import write_search_record

        (out / "compact").mkdir(parents=True, exist_ok=True)
        write_search_record(Results(sweep_dir), out / "compact" / "search.csv")


def _shortened(arms: tuple[Arm, ...], epochs: int, milestones: tuple[int, ...]) -> tuple[Arm, ...]:
    """The arms with every trained arm cut to ``epochs`` (smoke runs and CI)."""
    return tuple(
        arm if arm.settings.get("epochs") == 0 else Arm(arm.name, arm.title, {**arm.settings, "epochs": epochs, "milestones": milestones})
        for arm in arms
    )


def study_parser(prog: str, description: str, datasets: dict[str, dict]):
    """The studies' options: which dataset, where, how many seeds, which arms, and the reports."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add = parser.add_argument
    add("--dataset", choices=list(datasets), default=next(iter(datasets)), help="(default: %(default)s)")
    add("--data-root", help="where the dataset's files are (the dataset's default otherwise)")
    prefixes = sorted({definition.get("prefix", "fidelity") for definition in datasets.values()})
    add("--results-dir", "--out", dest="out", metavar="DIR",  # a sweep's flag; --out, its first name, still read
        help=f"the study's results directory (default: results/{'|'.join(prefixes)}-DATASET[-quick])")
    add("--resume", action="store_true", help="continue an interrupted study in --results-dir")
    add("--seeds", type=int, help="training seeds per arm (default: the dataset's)")
    add("--arms", help="a comma-separated subset of the arms, the searched ones too with --searched-from (default: all)")
    add("--quick", action="store_true", help="a smoke run at the dataset's small sizes (a training subset, 1-2 epochs, 2 seeds)")
    add("--concurrency", type=int, help="trials at once (default: the dataset's)")
    add("--address", help="a Ray cluster to run on (default: as the sweep scripts)")
    add(
        "--searched-from",
        metavar="SWEEP_DIR",
        help=(
            "add the searched arms: each method of this finished Optuna sweep (run with the study's dataset, "
            "alpha and schedule) at the configuration its search picked, re-trained with every seed"
        ),
    )
    add(
        "--report-from",
        metavar="FOLDER",
        nargs="+",
        help=(
            "print the study's tables from its compact results (a study's compact/ folder, e.g. the copy under "
            "docs/results/, or a league's, whose re-trained picks are read as the study's searched arms; several "
            "are read as one study) and exit: nothing is trained"
        ),
    )
    add(
        "--report-now",
        action="store_true",
        help=(
            "write and print the tables of the trials --results-dir holds now (its compact/ and fidelity.md) and exit: "
            "nothing is trained; for a study stopped part way (name the arms and --searched-from it ran with)"
        ),
    )
    return parser


def study_from_args(args, definition: dict, parser) -> Study:
    """The study ``args`` describe for one dataset's ``definition`` (the --quick sizes, the
    searched arms, a subset of arms, the seeds); one line, exit 2, for a bad option."""
    from dpsm_ray.config import ConfigError
    from dpsm_ray.sweep.spec import SweepError

    prog = parser.prog
    common = {**definition["common"], **(definition["quick"]["common"] if args.quick else {})}
    if args.data_root:
        common["data_root"] = args.data_root
    arms = definition["arms"]
    if args.quick:
        arms = _shortened(arms, definition["quick"]["epochs"], definition["quick"]["milestones"])
    if args.searched_from:  # after the fixed arms
        expected = TrainConfig.from_dict(  # paths absolute, as the sweep recorded its own
            {**common, **({"epochs": definition["quick"]["epochs"], "milestones": definition["quick"]["milestones"]} if args.quick else {})}
        ).with_absolute_paths()
        try:
            searched = searched_arms(Path(args.searched_from), expected, log=lambda line: print(line, flush=True),
                                     differing=tuple(definition.get("differing", ())))
        except SweepError as error:
            parser.exit(2, f"{prog}: error: {error}\n")
        quick = definition["quick"]
        arms = (*arms, *(_shortened(searched, quick["epochs"], quick["milestones"]) if args.quick else searched))
    if args.arms:  # a subset, in the study's order (its tables keep one order however it was run)
        wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = [a for a in wanted if a not in {arm.name for arm in arms}]
        if unknown:
            searched = not args.searched_from and any(name.startswith("searched_") for name in unknown)
            searched_hint = " (the searched arms need --searched-from)" if searched else ""
            parser.error(f"--arms: unknown {', '.join(unknown)}; the arms are {', '.join(arm.name for arm in arms)}{searched_hint}")
        arms = tuple(arm for arm in arms if arm.name in wanted)
    seeds = args.seeds or (definition["quick"]["seeds"] if args.quick else definition["seeds"])
    if seeds < 2:
        parser.error(f"--seeds must be an integer >= 2 (the intervals are over seeds); got {seeds}")
    try:
        config = TrainConfig.from_dict(common)
        study = Study(
            name=f"{definition.get('prefix', 'fidelity')}-{args.dataset}",
            common=config,
            arms=arms,
            seeds=tuple(range(config.seed, config.seed + seeds)),
            concurrency=args.concurrency or definition.get("concurrency", 1),
            trial_resources=(("cpu", config.cpus_per_worker), *((("gpu", config.gpus_per_worker),) if config.gpus_per_worker else ())),
            address=args.address,
            comparisons=tuple(definition.get("comparisons", ())),
            batch_pairs=tuple(definition.get("batch_pairs", ())),
            mechanism=tuple(definition.get("mechanism", ())),
            claim=tuple(definition.get("claim", ())),
            claim_rule=definition.get("claim_rule", "decisive"),
            seed_groups=tuple(definition.get("seed_groups", ())),
        )
        for arm in study.arms:
            study.arm_config(arm)
    except ConfigError as error:
        parser.exit(2, f"{prog}: error: {error}\n")
    return study


def cli(prog: str, description: str, datasets: dict[str, dict], argv=None, *, estimate=None) -> int:
    """The command line of ``sweeps/fidelity.py``, ``sweeps/decisive.py`` and
    ``sweeps/cifar100_fidelity.py``: ``datasets`` maps a name to ``{"common": TrainConfig fields,
    "arms": (Arm, ...), "seeds": n, "concurrency": c, "quick": {"common": ..., "seeds": n, "epochs":
    e, "milestones": m}}`` and optionally the analysis' ``comparisons``, ``batch_pairs`` and
    ``mechanism``, ``claim``, ``claim_rule`` and ``seed_groups`` (``Study``'s), the results directory's ``prefix`` (default ``fidelity``),
    ``differing`` (the settings its searched arms may have been searched with otherwise:
    ``searched_arms``) and ``report_only`` (why a dataset is only read, from a league's results, never run);
    ``estimate(study)``, if given, is printed before the study starts.  Exit status as every
    command's (``dpsm_ray.sweep.exits``)."""
    import dataclasses
    import sys
    import time

    from dpsm_ray.sweep.exits import exit_codes
    from dpsm_ray.sweep.options import parse_strictly
    from dpsm_ray.sweep.spec import SweepError, SweepFinished
    from dpsm_ray.train.ray_session import leaving_ray_as_it_was

    parser = study_parser(prog, description, datasets)
    args = parse_strictly(parser, argv)
    definition = datasets[args.dataset]
    study = study_from_args(args, definition, parser)
    if args.report_from:
        try:  # a league's searches are read as the study's searched arms, under the study's criterion
            evals, runs, arms, failed, alphas = read_study_folders(args.report_from)
        except (FileNotFoundError, ValueError) as error:
            parser.exit(2, f"{prog}: error: --report-from: {error}\n")
        for folder, alpha in zip(args.report_from, alphas):
            if alpha is not None and alpha != study.common.alpha:
                parser.exit(2, f"{prog}: error: --report-from {folder}: a league at alpha {alpha:g}; {args.dataset}'s study is at "
                               f"alpha {study.common.alpha:g}\n")
        print(markdown_report(analyse_tables(dataclasses.replace(study, arms=arms), evals, runs, failed)))
        return 0
    if definition.get("report_only"):
        parser.exit(2, f"{prog}: error: --dataset {args.dataset}: {definition['report_only']}\n")
    out = Path(args.out or f"results/{definition.get('prefix', 'fidelity')}-{args.dataset}{'-quick' if args.quick else ''}")
    if args.report_now:
        try:
            print(markdown_report(_report_study(study, out, log=lambda line: print(line, flush=True))))
        except SweepError as error:
            parser.exit(2, f"{prog}: error: --report-now: {error}\n")
        keep_search_record(args.searched_from, out)
        return 0
    if estimate is not None:
        print(estimate(study), flush=True)
    started = time.perf_counter()
    with exit_codes(parser, where=lambda: out.resolve()), leaving_ray_as_it_was():
        try:
            analysis = run_study(study, out, resume=args.resume, log=lambda line: print(line, flush=True))
        except SweepFinished:  # the same command again: what it made
            print(markdown_report(analyse(study, out.resolve())))
            keep_search_record(args.searched_from, out)
            print(f"{prog}: {out} holds this finished study (its tables are above); --resume runs arms added since, another "
                  "--results-dir a new one")
            return 0
    print(markdown_report(analysis))
    keep_search_record(args.searched_from, out)
    print(f"study finished in {time.perf_counter() - started:.0f}s; results in {out.resolve()} (fidelity.md, fidelity.json, *.parquet)")
    sys.stdout.flush()
    return 0
