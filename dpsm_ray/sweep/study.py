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
``fidelity.json`` / ``fidelity.md`` (the tables).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from dpsm_ray.results.stats import T_LEVEL, paired_change
from dpsm_ray.train.config import TrainConfig

REFERENCES = ("ce", "base")  # every arm is compared with CE fine-tuned and with the base model
STUDY_FILE = "study.json"


@dataclass(frozen=True)
class Arm:
    """A method and its settings (``TrainConfig`` fields over the study's common ones)."""

    name: str
    title: str
    settings: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Study:
    name: str
    common: TrainConfig  # dataset, model, alpha, evaluation, the fine-tuning schedule, where trials run
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    concurrency: int = 1
    trial_resources: tuple[tuple[str, float], ...] = (("cpu", 1.0),)
    trial_retries: int = 2
    address: str | None = None
    resource_timeout: float = 600.0

    def arm_config(self, arm: Arm, results: Path | None = None) -> TrainConfig:
        """``arm``'s configuration (seed 0), with the base-model cache of ``results``; validated."""
        values = {**self.common.to_dict(), **arm.settings, "split_seed": self.common.seed, "evaluate_test": True}
        if results is not None:
            values["cache_dir"] = str(results / "base_models")
        return TrainConfig.from_dict(values).with_absolute_paths()

    def describe(self) -> dict:
        return {"name": self.name, "common": self.common.to_dict(), "seeds": list(self.seeds),
                "arms": {arm.name: json.loads(json.dumps(arm.settings, default=list)) for arm in self.arms}}


def run_study(study: Study, results_dir: str | os.PathLike, *, resume: bool = False, log=print) -> dict:
    """Run (or continue) every arm of ``study`` into ``results_dir``; returns the analysis."""
    from dpsm_ray.data import check_data_present
    from dpsm_ray.files import read_checked_json, remove_temporaries, write_checked_json
    from dpsm_ray.sweep.ledger import ResultsInUse, ResultsLock
    from dpsm_ray.sweep.protocol import quiet_libraries
    from dpsm_ray.sweep.spec import SweepError, SweepInterrupted, claim_results_dir
    from dpsm_ray.sweep.progress import Progress
    from dpsm_ray.sweep.stage import Stage, StageInterrupted, StageOutOfSpace, run_stages
    from dpsm_ray.train.ray_session import check_before_start, check_capacity, ensure_ray, run_demand

    results = Path(results_dir).resolve()
    configs = {arm.name: study.arm_config(arm, results) for arm in study.arms}  # every arm valid before anything starts
    check_data_present(study.common.dataset, study.common.data_root, study.common.download)
    claim_results_dir(results)
    lock = ResultsLock(results)
    try:
        lock.acquire()
    except ResultsInUse as error:
        raise SweepError(str(error)) from None
    try:
        marker, described = results / STUDY_FILE, json.loads(json.dumps(study.describe(), default=list))
        if marker.exists():
            if not resume:
                raise SweepError(f"{results} already holds a study; pass --resume to continue it, or choose another --out")
            if read_checked_json(marker) != described:
                raise SweepError(f"--resume: the study in {results} was started with other settings; rerun it with the same options")
        elif resume:
            raise SweepError(f"--resume: no study to resume in {results}")
        remove_temporaries(results, skip=("tune",))
        demand = run_demand(study.common.workers, study.common.cpus_per_worker, study.common.gpus_per_worker, own=dict(study.trial_resources))
        check_before_start(demand, study.address)
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
        quiet_libraries()
        ensure_ray(study.address, worker_output=False)
        check_capacity(demand, timeout_s=study.resource_timeout, log=log)
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
        try:
            run_stages(stages[:1], results, name="study", resources=dict(study.trial_resources), concurrency=study.concurrency,
                       retries=study.trial_retries, log=progress, then=the_other_arms if len(stages) > 1 else None)
        except StageInterrupted as error:
            raise SweepInterrupted(f"{error}; rerun with --resume to continue") from None
        except StageOutOfSpace as error:
            raise SweepError(f"{error}; free some space and rerun with --resume to continue") from None
        write_study_results(study, results)
        return analyse(study, results)
    finally:
        lock.release()


def write_study_results(study: Study, results: Path) -> None:
    from dpsm_ray.results.store import write_parquet
    from dpsm_ray.sweep.collect import FILES, collect
    from dpsm_ray.sweep.ledger import Ledger

    ledger, rows = Ledger(results), {name: [] for name in FILES}
    labelled = SimpleNamespace(name=study.name, coverage_floor=1 - study.common.alpha)
    for arm in study.arms:
        for file, part in collect(labelled, ledger, arm.name, arm.name).items():
            rows[file] += part
    for file, schema in FILES.items():
        write_parquet(results / f"{file}.parquet", rows[file], schema)


# ----------------------------------------------------------------------------- the analysis


def analyse(study: Study, results: Path) -> dict:
    """The tables of ``fidelity.md``: each arm's metrics, its per-seed changes against CE and the
    base model, and the quantile diagnostics of the arms that learn one."""
    import pandas as pd

    evals, epochs = pd.read_parquet(results / "evals.parquet"), pd.read_parquet(results / "epochs.parquet")
    present = [arm for arm in study.arms if arm.name in set(evals.stage)]
    scores = [s for s in ("hps", "aps", "raps") if s in set(evals.score)]
    table = []
    for arm in present:
        part = evals[evals.stage == arm.name]
        row = {"arm": arm.name, "title": arm.title, "models": int(part.run_id.nunique())}
        for score in scores:
            values = part[part.score == score]
            row[score] = {"set_size": float(values.set_size.mean()), "set_size_std": float(values.set_size.std(ddof=1)),
                          "coverage": float(values.coverage.mean()), "covgap": float(values.covgap.mean())}
        row["accuracy"] = float(part.accuracy.mean())
        table.append(row)
    names = [arm.name for arm in present]
    comparisons = [paired_change(evals, arm, against, score) for against in REFERENCES if against in names
                   for arm in names if arm != against for score in scores]
    diagnostics = []
    for arm in present:
        runs = epochs[epochs.stage == arm.name]
        if runs.empty or runs.q.isna().all():
            continue
        last = runs.sort_values("epoch").groupby("run_id").tail(1)
        diagnostics.append({"arm": arm.name, **{c: float(last[c].mean()) for c in ("q", "q_dataset_train", "q_error_train", "train_set_size_q", "val_set_size")},
                            "q_error_train_all_epochs": float(runs.q_error_train.mean())})
    analysis = {"study": study.name, "dataset": study.common.dataset, "alpha": study.common.alpha, "seeds": list(study.seeds),
                "eval_splits": study.common.eval_splits, "table": table, "comparisons": comparisons, "diagnostics": diagnostics}
    from dpsm_ray.files import write_json, write_text

    write_json(results / "fidelity.json", analysis)
    write_text(results / "fidelity.md", markdown_report(analysis) + "\n")
    return analysis


def fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def interval_text(change: dict) -> str:
    marker = "" if change["significant"] else " (n.s.)"
    return f"{change['mean']:+.1f}% [{fmt(change['low'], 1)}, {fmt(change['high'], 1)}]{marker}"


def markdown_report(analysis: dict) -> str:
    from dpsm_ray.results.report import markdown

    scores = [s for s in ("hps", "aps", "raps") if analysis["table"] and s in analysis["table"][0]]
    lines = [f"**{analysis['dataset']}, alpha {analysis['alpha']:g}**: {len(analysis['seeds'])} training seeds x {analysis['eval_splits']} "
             "calibration/test re-splits; set size mean ± std over seeds and re-splits.", ""]
    rows = [["arm", *[f"{s.upper()} size" for s in scores], *[f"{s.upper()} coverage" for s in scores], "accuracy"]]
    for row in analysis["table"]:
        rows.append([f"{row['title']} (`{row['arm']}`)", *[f"{fmt(row[s]['set_size'])} ± {fmt(row[s]['set_size_std'])}" for s in scores],
                     *[fmt(row[s]["coverage"], 3) for s in scores], fmt(row["accuracy"], 3)])
    lines += [markdown(rows), ""]
    for against in REFERENCES:
        part = [c for c in analysis["comparisons"] if c["against"] == against]
        if not part:
            continue
        title = "CE fine-tuned (the same protocol)" if against == "ce" else "the CE base model (the paper's CE column)"
        lines += [f"Per-seed change of the set size against {title}, mean [{T_LEVEL:.0%} t interval] over the seeds "
                  "(negative: smaller sets; n.s.: the interval holds 0).", ""]
        rows = [["arm", *[s.upper() for s in scores]]]
        for arm in dict.fromkeys(c["arm"] for c in part):
            rows.append([arm, *[interval_text(next(c for c in part if c["arm"] == arm and c["score"] == s)) for s in scores]])
        lines += [markdown(rows), ""]
    if analysis["diagnostics"]:
        lines += ["Quantile diagnostics at the last epoch (mean over seeds): the learned q (DPSM) or batch tau (ConfTr), "
                  "Q_n of the training split, \\|q - Q_n\\| (and its mean over all epochs), the training set size at q, the validation set size.", ""]
        rows = [["arm", "q", "Q_n train", "\\|q - Q_n\\|", "\\|q - Q_n\\| all epochs", "train size at q", "val size"]]
        rows += [[d["arm"], fmt(d["q"], 4), fmt(d["q_dataset_train"], 4), fmt(d["q_error_train"], 4), fmt(d["q_error_train_all_epochs"], 4),
                  fmt(d["train_set_size_q"]), fmt(d["val_set_size"])] for d in analysis["diagnostics"]]
        lines += [markdown(rows), ""]
    return "\n".join(lines)


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
        Arm("dpsm_official", "DPSM as its official code trains it", {"method": "dpsm", **preset_values("official", "dpsm", schedule=False)}),
        Arm("dpsm", "DPSM at this project's defaults", {"method": "dpsm"}),
        # the tex's Algorithm 1 as this project followed it until issue 28: CE on B1 only, T 0.1, lambda 0.5
        Arm("dpsm_tex", "DPSM, CE on B1 only (the tex), T 0.1, lambda 0.5", {"method": "dpsm", "ce_batch": "half", "sigmoid_temperature": 0.1, "conformal_weight": 0.5}),
        Arm("conftr", "ConfTr as the DPSM paper describes it", {"method": "conftr"}),
        Arm("cut", "CUT", {"method": "cut"}),
    ]
    if published:
        arms.append(Arm("conftr_published", "ConfTr as published (Stutz et al.), from scratch",
                        {"method": "conftr_published", **preset_values("official", "conftr_published")}))
    return tuple(arms)


def shortened(arms: tuple[Arm, ...], epochs: int, milestones: tuple[int, ...]) -> tuple[Arm, ...]:
    """The arms with every trained arm cut to ``epochs`` (smoke runs and CI)."""
    return tuple(arm if arm.settings.get("epochs") == 0 else Arm(arm.name, arm.title, {**arm.settings, "epochs": epochs, "milestones": milestones})
                 for arm in arms)


def cli(prog: str, description: str, datasets: dict[str, dict], argv=None, *, estimate=None) -> int:
    """The command line of ``sweeps/fidelity.py`` and ``sweeps/cifar100_fidelity.py``: ``datasets``
    maps a name to ``{"common": TrainConfig fields, "arms": (Arm, ...), "seeds": n, "concurrency": c,
    "quick": {"common": ..., "seeds": n, "epochs": e, "milestones": m}}``; ``estimate(study)``, if
    given, is printed before the study starts."""
    import argparse
    import sys
    import time

    from dpsm_ray.sweep.spec import ResultsDirUnusable, SweepError
    from dpsm_ray.train.config import ConfigError
    from dpsm_ray.train.ray_session import InsufficientResources, leaving_ray_as_it_was

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add = parser.add_argument
    add("--dataset", choices=list(datasets), default=next(iter(datasets)), help="(default: %(default)s)")
    add("--data-root", help="where the dataset's files are (the dataset's default otherwise)")
    add("--out", help="the study's directory (default: results/fidelity-DATASET[-quick])")
    add("--resume", action="store_true", help="continue an interrupted study in --out")
    add("--seeds", type=int, help="training seeds per arm (default: the dataset's)")
    add("--arms", help="a comma-separated subset of the arms (default: all)")
    add("--quick", action="store_true", help="a smoke run at the dataset's small sizes (a training subset, 1-2 epochs, 2 seeds)")
    add("--concurrency", type=int, help="trials at once (default: the dataset's)")
    add("--address", help="a Ray cluster to run on (default: as the sweep scripts)")
    args = parser.parse_args(argv)
    definition = datasets[args.dataset]
    common = {**definition["common"], **(definition["quick"]["common"] if args.quick else {})}
    if args.data_root:
        common["data_root"] = args.data_root
    arms = definition["arms"]
    if args.quick:
        arms = shortened(arms, definition["quick"]["epochs"], definition["quick"]["milestones"])
    if args.arms:
        wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = [a for a in wanted if a not in {arm.name for arm in arms}]
        if unknown:
            parser.error(f"--arms: unknown {', '.join(unknown)}; the arms are {', '.join(arm.name for arm in arms)}")
        arms = tuple(arm for arm in arms if arm.name in wanted)
    seeds = args.seeds or (definition["quick"]["seeds"] if args.quick else definition["seeds"])
    if seeds < 2:
        parser.error(f"--seeds must be an integer >= 2 (the intervals are over seeds); got {seeds}")
    try:
        config = TrainConfig.from_dict(common)
        study = Study(name=f"fidelity-{args.dataset}", common=config, arms=arms, seeds=tuple(range(config.seed, config.seed + seeds)),
                      concurrency=args.concurrency or definition.get("concurrency", 1),
                      trial_resources=(("cpu", config.cpus_per_worker), *((("gpu", config.gpus_per_worker),) if config.gpus_per_worker else ())),
                      address=args.address)
        for arm in study.arms:
            study.arm_config(arm)
    except ConfigError as error:
        parser.exit(2, f"{prog}: error: {error}\n")
    out = Path(args.out or f"results/fidelity-{args.dataset}{'-quick' if args.quick else ''}")
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
