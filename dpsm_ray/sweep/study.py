"""The fidelity study: does a method, trained as the paper trained it, make smaller sets than CE?

A study runs fixed *arms* -- a method and its settings, no search -- each with every seed, on the
sweep service's machinery: one stage per arm in one Tune experiment (the first arm, then the others
beside each other), the ledger, the lock, resume, the cluster path.
Every arm that fine-tunes starts, for seed s, from seed s's CE base model (trained once, in the
first trial that needs it, and cached under ``RESULTS/base_models``); the ``base`` arm evaluates
those base models as they are -- the paper's CE column.  Every model is evaluated by the same
protocol (the calibration/test split of the study's seed, ``eval_splits`` re-splits, HPS, APS and
RAPS), and arms are compared per seed: the percent change of the mean set size against CE
fine-tuned and against the base model, with a Student t interval over the seeds -- the seeds are
the independent replicates, a model's re-splits are not.

Writes ``trials.parquet``, ``epochs.parquet``, ``evals.parquet`` and ``classes.parquet`` (the
``stage`` column names the arm), ``study.json`` (the settings a resume must match) and
``fidelity.json`` / ``fidelity.md`` (the tables: ``dpsm_ray/results/studies.py``).  Here: running
a study, its arms (the fidelity study's, the decisive test's, a search's picks) and its command line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from dpsm_ray.config import TrainConfig
from dpsm_ray.results.studies import SEARCHED_METHODS, STUDY_FILE, Arm, Study, analyse, analyse_tables, markdown_report, read_compact

def run_study(study: Study, results_dir: str | os.PathLike, *, resume: bool = False, log=print) -> dict:
    """Run (or continue) every arm of ``study`` into ``results_dir``, through the sweep driver's
    preamble and stage machinery (``dpsm_ray.sweep.protocol``: an arm is a stage whose points --
    its seeds -- are given, not searched); returns the analysis."""
    from dpsm_ray.files import read_checked_json, write_checked_json
    from dpsm_ray.sweep.progress import Progress
    from dpsm_ray.sweep.protocol import before_ray, holding, run_in_tune, start_ray
    from dpsm_ray.sweep.spec import SweepError
    from dpsm_ray.sweep.stage import Stage
    from dpsm_ray.train.ray_session import run_demand

    results = Path(results_dir).resolve()
    configs = {arm.name: study.arm_config(arm, results) for arm in study.arms}  # every arm valid before anything starts
    with holding(results, study.common, log):
        marker, described = results / STUDY_FILE, json.loads(json.dumps(study.describe(), default=list))
        if marker.exists():
            if not resume:
                raise SweepError(f"{results} already holds a study; pass --resume to continue it, or choose another --out")
            stored = read_checked_json(marker)
            if not continues(stored, described):
                raise SweepError(f"--resume: the study in {results} was started with other settings; rerun it with the same options "
                                 "(a resumed study may add arms or run a subset of them with --arms, never change one)")
            every = {**stored, "arms": {**stored["arms"], **described["arms"]}}  # the arms run now, and those it has had
            if stored != every:
                write_checked_json(marker, every)  # the arms added now: a later resume must name them too
        elif resume:
            raise SweepError(f"--resume: no study to resume in {results}")
        demand = run_demand(
            study.common.workers, study.common.cpus_per_worker, study.common.gpus_per_worker, own=dict(study.trial_resources)
        )
        before_ray(results, demand, study.address, log)
        start_ray(demand, study.address, study.resource_timeout, False, log)
        if not marker.exists():
            write_checked_json(marker, described)
        stages = [Stage(arm.name, configs[arm.name], len(study.seeds), ("seed",), points=[{"seed": seed} for seed in study.seeds])
                  for arm in study.arms]
        for arm in study.arms:
            log(f"arm {arm.name}: {arm.title}, {len(study.seeds)} seeds")
        progress = Progress(log)
        progress.plan(sum(stage.total for stage in stages))

        def the_other_arms() -> list[Stage]:
            write_study_results(study, results)
            return stages[1:]

        # One Tune experiment, its trial processes handed from trial to trial: the first arm's
        # trials train each seed's base model (into the cache) and end before the other arms,
        # which start from those models, run beside each other.
        run_in_tune(stages[:1], results, name="study", resources=dict(study.trial_resources), concurrency=study.concurrency,
                    retries=study.trial_retries, log=progress, then=the_other_arms if len(stages) > 1 else None)
        write_study_results(study, results)
        return analyse(study, results)


def report_study(study: Study, results_dir: str | os.PathLike, log=print) -> dict:
    """The analysis of the trials ``results_dir`` holds now -- its Parquet files, ``compact/`` and
    ``fidelity.md`` written from its ledger -- with nothing trained and no Ray started: a study
    stopped part way is reported as far as it got (each arm's model count says how far).
    SweepError if there is no such study there, or a driver holds it."""
    from dpsm_ray.files import read_checked_json
    from dpsm_ray.sweep.protocol import holding
    from dpsm_ray.sweep.spec import SweepError

    results = Path(results_dir).resolve()
    if not (results / STUDY_FILE).is_file():
        raise SweepError(f"no study in {results} (no {STUDY_FILE})")
    with holding(results, study.common, log):
        if not continues(read_checked_json(results / STUDY_FILE), json.loads(json.dumps(study.describe(), default=list))):
            raise SweepError(f"the study in {results} was started with other settings; name the options it was run with")
        write_study_results(study, results)
        return analyse(study, results)


def continues(stored: dict, described: dict) -> bool:
    """Whether ``described`` continues the study ``stored`` describes: the same settings and seeds,
    and every arm both name unchanged; arms may be added (the searched arms, once their sweep is
    done) or left out (``--arms``: a subset runs, the others keep what they have)."""
    same = all(stored.get(key) == described.get(key) for key in ("name", "common", "seeds"))
    return same and all(stored.get("arms", {}).get(name, settings) == settings for name, settings in described["arms"].items())


def write_study_results(study: Study, results: Path) -> None:
    from dpsm_ray.results.store import write_parquet
    from dpsm_ray.sweep.collect import FILES, collect
    from dpsm_ray.results.layout import Ledger

    ledger, rows = Ledger(results), {name: [] for name in FILES}
    labelled = SimpleNamespace(name=study.name, coverage_floor=1 - study.common.alpha)
    for arm in study.arms:
        for file, part in collect(labelled, ledger, arm.name, arm.name).items():
            rows[file] += part
    for file, schema in FILES.items():
        write_parquet(results / f"{file}.parquet", rows[file], schema)


# ----------------------------------------------------------------------------- the arms


def fidelity_arms(published: bool = False) -> tuple[Arm, ...]:
    """The study's arms (docs/fidelity.md): the base model, CE fine-tuned, DPSM three ways (its
    official code's settings, this project's defaults, the tex's Algorithm 1 as this project read
    it before), ConfTr and CUT at their defaults, and, with ``published``, ConfTr as Stutz et al.
    published it (from scratch, their recipe: the Fashion-MNIST one)."""
    from dpsm_ray.train.presets import preset_values

    arms = [
        Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0}),
        Arm("ce", "CE fine-tuned", {"method": "ce"}),
        Arm(
            "dpsm_official", "DPSM as its official code trains it", {"method": "dpsm", **preset_values("official", "dpsm", schedule=False)}
        ),
        Arm("dpsm", "DPSM at this project's defaults", {"method": "dpsm"}),
        # the tex's Algorithm 1 as this project followed it before it trained as the official code does: CE on B1 only, T 0.1, lambda 0.5
        Arm(
            "dpsm_tex",
            "DPSM, CE on B1 only (the tex), T 0.1, lambda 0.5",
            {"method": "dpsm", "ce_batch": "half", "sigmoid_temperature": 0.1, "conformal_weight": 0.5},
        ),
        Arm("conftr", "ConfTr as the DPSM paper describes it", {"method": "conftr"}),
        Arm("cut", "CUT", {"method": "cut"}),
    ]
    if published:
        arms.append(Arm("conftr_published", "ConfTr as published (Stutz et al.), from scratch",
                        {"method": "conftr_published", **preset_values("official", "conftr_published")}))
    return tuple(arms)


def decisive_arms() -> tuple[Arm, ...]:
    """The decisive test's fixed arms (docs/fidelity.md, written before its results): the base
    model and CE fine-tuned; DPSM with its size term on (CE on the whole batch, T 0.1) against
    ConfTr and CUT (CUT has no T) at lambda 0.5 and 0.1; from DPSM at lambda 0.5 each of the tex's
    three changes alone (CE on B1 only; T 1; lambda 0.05); DPSM and ConfTr at lambda 0.5 with batch
    32 and 512 (the lambda 0.5 arms are batch 128, the study's schedule).  In the order they run:
    the lambda 0.1 arms last, as the criterion's budget rule cuts them first."""
    on = {"method": "dpsm", "ce_batch": "full", "sigmoid_temperature": 0.1}
    conftr = {"method": "conftr", "sigmoid_temperature": 0.1}
    def mechanism(weight: float, tag: str) -> list[Arm]:
        return [
            Arm(f"dpsm_{tag}", f"DPSM, size term on: CE on the whole batch, T 0.1, lambda {weight:g}", {**on, "conformal_weight": weight}),
            Arm(f"conftr_{tag}", f"ConfTr, T 0.1, lambda {weight:g}", {**conftr, "conformal_weight": weight}),
            Arm(f"cut_{tag}", f"CUT, lambda {weight:g}", {"method": "cut", "conformal_weight": weight}),
        ]

    arms = [
        Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0}),
        Arm("ce", "CE fine-tuned", {"method": "ce"}),
    ]
    arms += mechanism(0.5, "l05")
    arms += [
        Arm(
            "dpsm_l05_ceb1",
            "DPSM lambda 0.5 T 0.1, CE on B1 only (the tex's change alone)",
            {**on, "conformal_weight": 0.5, "ce_batch": "half"},
        ),
        Arm("dpsm_l05_t1", "DPSM lambda 0.5, T 1 (the tex's change alone)", {**on, "conformal_weight": 0.5, "sigmoid_temperature": 1.0}),
        Arm("dpsm_l005", "DPSM T 0.1, lambda 0.05 (the tex's change alone)", {**on, "conformal_weight": 0.05}),
    ]
    for batch in (32, 512):
        arms += [
            Arm(f"dpsm_l05_b{batch}", f"DPSM lambda 0.5 T 0.1, batch {batch}", {**on, "conformal_weight": 0.5, "batch_size": batch}),
            Arm(
                f"conftr_l05_b{batch}", f"ConfTr lambda 0.5 T 0.1, batch {batch}", {**conftr, "conformal_weight": 0.5, "batch_size": batch}
            ),
        ]
    # last: the criterion's budget rule cuts them first (docs/fidelity.md)
    return tuple(arms + mechanism(0.1, "l01"))


# the decisive test's analysis: its comparisons, the batch-size prediction's pairs, the mechanism's triples
DECISIVE_ANALYSIS = {
    "comparisons": (("dpsm_l05", "conftr_l05"), ("dpsm_l05", "cut_l05"), ("dpsm_l01", "conftr_l01"), ("dpsm_l01", "cut_l01"),
                    ("dpsm_l05_ceb1", "dpsm_l05"), ("dpsm_l05_t1", "dpsm_l05"), ("dpsm_l005", "dpsm_l05"),
                    ("searched_dpsm", "searched_ce"), ("searched_dpsm", "searched_conftr"), ("searched_dpsm", "searched_cut")),
    "batch_pairs": ((32, "dpsm_l05_b32", "conftr_l05_b32"), (128, "dpsm_l05", "conftr_l05"), (512, "dpsm_l05_b512", "conftr_l05_b512")),
    "mechanism": (("dpsm_l05", "conftr_l05", "cut_l05"), ("dpsm_l01", "conftr_l01", "cut_l01")),
}
METHOD_TITLES = {"ce": "CE fine-tuned", "conftr": "ConfTr", "cut": "CUT", "dpsm": "DPSM"}
# the settings a sweep must share with the study for its picks to be the study's searched arms
SHARED_WITH_THE_SWEEP = (
    "dataset",
    "alpha",
    "model",
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


def searched_arms(sweep_dir: Path, common: TrainConfig, log=print) -> tuple[Arm, ...]:
    """``searched_<method>`` for each of CE, ConfTr, CUT and DPSM that the finished Optuna sweep in
    ``sweep_dir`` searched: the method at the configuration its search picked (the sweep's own
    rule, dpsm_ray/sweep/pick.py), re-trained by the study with every seed from the study's base
    models.  SweepError if the sweep is not one the study can use."""
    from dpsm_ray.sweep.pick import best_overrides
    from dpsm_ray.results.layout import SWEEP_FILE
    from dpsm_ray.sweep.spec import SweepError, read_sweep_file

    sweep_dir = Path(sweep_dir)
    if not (sweep_dir / SWEEP_FILE).is_file():
        raise SweepError(f"--searched-from {sweep_dir}: no sweep there (no sweep.json)")
    stored = read_sweep_file(sweep_dir)
    if stored.get("grid"):
        raise SweepError(f"--searched-from {sweep_dir}: a --grid sweep; the searched arms come from an Optuna search")
    ours = json.loads(json.dumps(common.to_dict(), default=list))
    for name in SHARED_WITH_THE_SWEEP:
        if stored["base"].get(name) != ours[name]:
            raise SweepError(
                f"--searched-from {sweep_dir}: its sweep ran with {name}={stored['base'].get(name)!r}, the study with {ours[name]!r}; "
                "search with the study's settings"
            )
    if not (sweep_dir / "trials.parquet").is_file():
        raise SweepError(f"--searched-from {sweep_dir}: the sweep has no finished search trials yet (no trials.parquet)")
    arms = []
    for method in SEARCHED_METHODS:
        if method in stored.get("methods", ()):
            overrides = best_overrides(SimpleNamespace(grid=False), sweep_dir, method, log)
            if overrides is not None:
                arms.append(
                    Arm(
                        f"searched_{method}",
                        f"{METHOD_TITLES[method]}, searched ({stored['trials']} Optuna trials)",
                        {"method": method, **overrides},
                    )
                )
    if not arms:
        raise SweepError(f"--searched-from {sweep_dir}: none of {', '.join(SEARCHED_METHODS)} has a search trial that finished")
    return tuple(arms)


def shortened(arms: tuple[Arm, ...], epochs: int, milestones: tuple[int, ...]) -> tuple[Arm, ...]:
    """The arms with every trained arm cut to ``epochs`` (smoke runs and CI)."""
    return tuple(
        arm if arm.settings.get("epochs") == 0 else Arm(arm.name, arm.title, {**arm.settings, "epochs": epochs, "milestones": milestones})
        for arm in arms
    )


def cli(prog: str, description: str, datasets: dict[str, dict], argv=None, *, estimate=None) -> int:
    """The command line of ``sweeps/fidelity.py``, ``sweeps/decisive.py`` and
    ``sweeps/cifar100_fidelity.py``: ``datasets`` maps a name to ``{"common": TrainConfig fields,
    "arms": (Arm, ...), "seeds": n, "concurrency": c, "quick": {"common": ..., "seeds": n, "epochs":
    e, "milestones": m}}`` and optionally the analysis' ``comparisons``, ``batch_pairs`` and
    ``mechanism`` (``Study``'s) and the results directory's ``prefix`` (default ``fidelity``);
    ``estimate(study)``, if given, is printed before the study starts."""
    import argparse
    import dataclasses
    import sys
    import time

    from dpsm_ray.sweep.options import parse_strictly
    from dpsm_ray.sweep.spec import ResultsDirUnusable, SweepError
    from dpsm_ray.config import ConfigError
    from dpsm_ray.train.ray_session import InsufficientResources, leaving_ray_as_it_was

    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add = parser.add_argument
    add("--dataset", choices=list(datasets), default=next(iter(datasets)), help="(default: %(default)s)")
    add("--data-root", help="where the dataset's files are (the dataset's default otherwise)")
    add("--out", help="the study's directory (default: results/fidelity-DATASET[-quick])")
    add("--resume", action="store_true", help="continue an interrupted study in --out")
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
        help=(
            "print the study's tables from its compact results (a study's compact/ folder, e.g. the copy under "
            "docs/results/) and exit: nothing is trained"
        ),
    )
    add(
        "--report-now",
        action="store_true",
        help=(
            "write and print the tables of the trials --out holds now (its compact/ and fidelity.md) and exit: "
            "nothing is trained; for a study stopped part way (name the arms and --searched-from it ran with)"
        ),
    )
    args = parse_strictly(parser, argv)
    definition = datasets[args.dataset]
    common = {**definition["common"], **(definition["quick"]["common"] if args.quick else {})}
    if args.data_root:
        common["data_root"] = args.data_root
    arms = definition["arms"]
    if args.quick:
        arms = shortened(arms, definition["quick"]["epochs"], definition["quick"]["milestones"])
    if args.searched_from:  # after the fixed arms
        expected = TrainConfig.from_dict(
            {**common, **({"epochs": definition["quick"]["epochs"], "milestones": definition["quick"]["milestones"]} if args.quick else {})}
        )
        try:
            searched = searched_arms(Path(args.searched_from), expected, log=lambda line: print(line, flush=True))
        except SweepError as error:
            parser.exit(2, f"{prog}: error: {error}\n")
        arms = (*arms, *(shortened(searched, definition["quick"]["epochs"], definition["quick"]["milestones"]) if args.quick else searched))
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
        )
        for arm in study.arms:
            study.arm_config(arm)
    except ConfigError as error:
        parser.exit(2, f"{prog}: error: {error}\n")
    if args.report_from:
        try:
            evals, runs, arms, failed = read_compact(Path(args.report_from))
            print(markdown_report(analyse_tables(dataclasses.replace(study, arms=arms), evals, runs, failed)))
        except FileNotFoundError as error:
            parser.exit(2, f"{prog}: error: {error}\n")
        return 0
    out = Path(args.out or f"results/{definition.get('prefix', 'fidelity')}-{args.dataset}{'-quick' if args.quick else ''}")
    if args.report_now:
        try:
            print(markdown_report(report_study(study, out, log=lambda line: print(line, flush=True))))
        except SweepError as error:
            parser.exit(2, f"{prog}: error: --report-now: {error}\n")
        return 0
    if estimate is not None:
        print(estimate(study), flush=True)
    started = time.perf_counter()
    with leaving_ray_as_it_was():
        try:
            analysis = run_study(study, out, resume=args.resume, log=lambda line: print(line, flush=True))
        except ResultsDirUnusable as error:  # bad input: 3 says "--resume continues"
            parser.exit(2, f"{prog}: error: {error}\n")
        except SweepError as error:
            parser.exit(3, f"{prog}: {error}\n")
        except (InsufficientResources, FileNotFoundError, ConnectionError) as error:
            parser.exit(2, f"{prog}: error: {error}\n")
        except KeyboardInterrupt:
            parser.exit(3, f"{prog}: interrupted; rerun with --resume to continue\n")
    print(markdown_report(analysis))
    print(f"study finished in {time.perf_counter() - started:.0f}s; results in {out.resolve()} (fidelity.md, fidelity.json, *.parquet)")
    sys.stdout.flush()
    return 0
