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

from dpsm_ray.cards import score_names
from dpsm_ray.results.stats import T_LEVEL, paired_change, per_seed_change, summary
from dpsm_ray.config import TrainConfig

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
    # the analysis only (not part of what a resume must match): (arm, against) comparisons beyond
    # CE and the base model, and the batch-size prediction's (batch, DPSM arm, ConfTr arm)
    comparisons: tuple[tuple[str, str], ...] = ()
    batch_pairs: tuple[tuple[int, str, str], ...] = ()
    # the mechanism criterion's (DPSM arm, ConfTr arm, CUT arm) at each lambda
    mechanism: tuple[tuple[str, str, str], ...] = ()

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
    from dpsm_ray.cards import check_data_present
    from dpsm_ray.files import read_checked_json, remove_temporaries, write_checked_json
    from dpsm_ray.results.layout import ResultsInUse, ResultsLock
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
            stored = read_checked_json(marker)
            if not continues(stored, described):
                raise SweepError(f"--resume: the study in {results} was started with other settings; rerun it with the same options "
                                 "(a resumed study may add arms or run a subset of them with --arms, never change one)")
            every = {**stored, "arms": {**stored["arms"], **described["arms"]}}  # the arms run now, and those it has had
            if stored != every:
                write_checked_json(marker, every)  # the arms added now: a later resume must name them too
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


# ----------------------------------------------------------------------------- the analysis

# The compact results of a study (``RESULTS/compact/``, small enough to commit beside the doc that
# quotes them): every model's evaluation rows, and one row per model of its quantile diagnostics.
COMPACT_EVALS = ("stage", "seed", "score", "split", "set_size", "coverage", "covgap", "accuracy")
COMPACT_RUNS = ("stage", "seed", "q", "q_dataset_train", "q_error_train", "train_set_size_q", "val_set_size", "q_error_train_all_epochs")


def write_compact(study: Study, results: Path) -> Path:
    """``results/compact/``: ``evals.csv`` and ``runs.csv`` from the study's Parquet files and
    ``arms.json`` (each arm's name, title and settings, in order) -- what ``analyse_tables`` reads,
    so the tables regenerate from a committed copy exactly as from the whole directory."""
    import pandas as pd

    from dpsm_ray.files import write_json, write_text

    evals, epochs = pd.read_parquet(results / "evals.parquet"), pd.read_parquet(results / "epochs.parquet")
    evals = evals[list(COMPACT_EVALS)].sort_values(["stage", "seed", "score", "split"])
    ordered = epochs.sort_values(["stage", "seed", "epoch"])
    runs = ordered.groupby(["stage", "seed"]).tail(1).set_index(["stage", "seed"])
    runs = runs.assign(q_error_train_all_epochs=ordered.groupby(["stage", "seed"]).q_error_train.mean()).reset_index()[list(COMPACT_RUNS)]
    folder = results / "compact"
    folder.mkdir(exist_ok=True)
    for name, table in (("evals", evals), ("runs", runs)):
        write_text(folder / f"{name}.csv", table.to_csv(index=False, float_format="%.17g"))
    write_json(folder / "arms.json", [{"name": arm.name, "title": arm.title, "settings": json.loads(json.dumps(arm.settings, default=list))} for arm in study.arms])
    return folder


def read_compact(folder: Path):
    """The evaluation rows, the per-model rows and the arms of a study's compact results."""
    import pandas as pd

    missing = [name for name in ("evals.csv", "runs.csv", "arms.json") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} holds no study results ({', '.join(missing)} missing): pass a study's compact/ folder")
    arms = tuple(Arm(arm["name"], arm["title"], arm["settings"]) for arm in json.loads((folder / "arms.json").read_text()))
    return pd.read_csv(folder / "evals.csv"), pd.read_csv(folder / "runs.csv"), arms


def analyse(study: Study, results: Path) -> dict:
    """Write the compact results, and ``fidelity.json`` / ``fidelity.md`` from them."""
    from dpsm_ray.files import write_json, write_text

    evals, runs, _ = read_compact(write_compact(study, results))
    analysis = analyse_tables(study, evals, runs)
    write_json(results / "fidelity.json", analysis)
    write_text(results / "fidelity.md", markdown_report(analysis) + "\n")
    return analysis


def analyse_tables(study: Study, evals, runs) -> dict:
    """The tables of ``fidelity.md``: each arm's metrics, its per-seed changes against CE and the
    base model and in the study's own comparisons, the batch-size gaps, and the quantile
    diagnostics of the arms that learn one."""
    present = [arm for arm in study.arms if arm.name in set(evals.stage)]
    scores = [s for s in score_names() if s in set(evals.score)]
    table = []
    for arm in present:
        part = evals[evals.stage == arm.name]
        row = {"arm": arm.name, "title": arm.title, "models": int(part.seed.nunique())}
        for score in scores:
            values = part[part.score == score]
            row[score] = {"set_size": float(values.set_size.mean()), "set_size_std": float(values.set_size.std(ddof=1)),
                          "coverage": float(values.coverage.mean()), "covgap": float(values.covgap.mean())}
        row["accuracy"] = float(part.accuracy.mean())
        table.append(row)
    names = [arm.name for arm in present]
    comparisons = [paired_change(evals, arm, against, score) for against in REFERENCES if against in names
                   for arm in names if arm != against for score in scores]
    comparisons += [{**paired_change(evals, arm, against, score), "own": True} for arm, against in study.comparisons
                    if arm in names and against in names for score in scores]
    diagnostics = []
    for arm in present:
        part = runs[runs.stage == arm.name]
        if part.empty or part.q.isna().all():
            continue
        diagnostics.append({"arm": arm.name, **{c: float(part[c].mean()) for c in ("q", "q_dataset_train", "q_error_train", "train_set_size_q", "val_set_size")},
                            "q_error_train_all_epochs": float(part.q_error_train_all_epochs.mean())})
    analysis = {"study": study.name, "dataset": study.common.dataset, "alpha": study.common.alpha, "seeds": sorted(int(seed) for seed in set(evals.seed)),
                "eval_splits": study.common.eval_splits, "table": table, "comparisons": comparisons, "diagnostics": diagnostics,
                "batch": batch_gaps(study, evals, runs, scores)}
    analysis["verdicts"] = verdicts(study, analysis, evals)
    return analysis


# The pre-registered criterion (docs/fidelity.md, "The decisive test"): the margin DPSM must beat the
# best searched baseline by, and how far from 1 - alpha an arm's coverage may be and still count.
CLAIM_MARGIN = 5.0
CRITERION_SCORES = ("hps", "aps")  # the scores the criterion judges (docs/fidelity.md)
COVERAGE_TOLERANCE = 0.005
SEARCHED_METHODS = ("ce", "conftr", "cut", "dpsm")


def verdicts(study: Study, analysis: dict, evals) -> dict:
    """The criterion's verdicts, where the study has the arms they need: ``claim`` (searched DPSM
    against the best searched baseline, HPS and APS) and ``mechanism`` (DPSM at the lambda that
    gives it the smaller HPS sets, against ConfTr and CUT at that lambda)."""
    rows = {row["arm"]: row for row in analysis["table"]}

    def covered(arm: str, score: str) -> bool:
        return abs(rows[arm][score]["coverage"] - (1 - study.common.alpha)) <= COVERAGE_TOLERANCE

    result = {}
    baselines = [f"searched_{m}" for m in SEARCHED_METHODS[:-1] if f"searched_{m}" in rows]
    if "searched_dpsm" in rows and baselines and all(s in rows["searched_dpsm"] for s in CRITERION_SCORES):
        claim = {}
        for score in CRITERION_SCORES:
            best = min(baselines, key=lambda arm: rows[arm][score]["set_size"])
            change = paired_change(evals, "searched_dpsm", best, score)
            claim[score] = {"against": best, **change, "coverage_ok": covered("searched_dpsm", score)}
        supported = all(c["coverage_ok"] and c["mean"] <= -CLAIM_MARGIN and c["high"] < 0 for c in claim.values())
        contradicted = any(c["low"] > -CLAIM_MARGIN for c in claim.values())
        result["claim"] = {**claim, "verdict": "supported" if supported else "contradicted" if contradicted else "inconclusive"}
    triples = [t for t in study.mechanism if set(t) <= set(rows)]
    if triples:
        dpsm, conftr, cut = min(triples, key=lambda t: rows[t[0]]["hps"]["set_size"])
        changes = {f"{score}_{other}": paired_change(evals, dpsm, other, score) for score in CRITERION_SCORES for other in (conftr, cut)}
        holds = all(c["high"] < 0 for c in changes.values()) and all(covered(dpsm, score) for score in CRITERION_SCORES)
        result["mechanism"] = {"dpsm": dpsm, "conftr": conftr, "cut": cut, "changes": changes, "verdict": "holds" if holds else "not shown"}
    return result


def batch_gaps(study: Study, evals, runs, scores: list[str]) -> dict | None:
    """The batch-size prediction (docs/fidelity.md): per batch, the per-seed gap of ConfTr over DPSM
    in set size, 100 (ConfTr - DPSM) / ConfTr, and the change of that gap from the largest batch to
    the smallest, per seed; beside them both methods' quantile errors."""
    pairs = [(batch, dpsm, conftr) for batch, dpsm, conftr in study.batch_pairs if {dpsm, conftr} <= set(evals.stage)]
    if len(pairs) < 2:
        return None
    pairs.sort()
    result = {"batches": [batch for batch, _, _ in pairs], "scores": {}}
    for score in scores:
        gaps = {batch: -per_seed_change(evals, dpsm, conftr, score) for batch, dpsm, conftr in pairs}
        small, large = gaps[pairs[0][0]], gaps[pairs[-1][0]]
        change = (small - large).dropna()
        means = [float(gaps[batch].mean()) for batch, _, _ in pairs]
        difference = summary(change.tolist())
        result["scores"][score] = {"gaps": [{"batch": batch, **summary(gaps[batch].tolist())} for batch, _, _ in pairs], "difference": difference,
                                   "holds": bool(difference["low"] > 0 and all(a >= b for a, b in zip(means, means[1:]))),
                                   "contradicted": bool(difference["high"] < 0)}
    result["errors"] = [{"batch": batch, **{f"{name}_q_error_train": float(runs[runs.stage == arm].q_error_train.mean()) for name, arm in (("dpsm", dpsm), ("conftr", conftr))}}
                        for batch, dpsm, conftr in pairs]
    return result


def fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def interval_text(change: dict) -> str:
    marker = "" if change["significant"] else " (n.s.)"
    return f"{change['mean']:+.1f}% [{fmt(change['low'], 1)}, {fmt(change['high'], 1)}]{marker}"


def detectable_text(change: dict) -> str:
    return f"±{fmt(change['detectable'], 1)}%"


def markdown_report(analysis: dict) -> str:
    from dpsm_ray.results.report import markdown

    scores = [s for s in score_names() if analysis["table"] and s in analysis["table"][0]]
    lines = [f"**{analysis['dataset']}, alpha {analysis['alpha']:g}**: {len(analysis['seeds'])} training seeds x {analysis['eval_splits']} "
             "calibration/test re-splits; set size mean ± std over seeds and re-splits.", ""]
    rows = [["arm", *[f"{s.upper()} size" for s in scores], *[f"{s.upper()} coverage" for s in scores], "accuracy"]]
    for row in analysis["table"]:
        rows.append([f"{row['title']} (`{row['arm']}`)", *[f"{fmt(row[s]['set_size'])} ± {fmt(row[s]['set_size_std'])}" for s in scores],
                     *[fmt(row[s]["coverage"], 3) for s in scores], fmt(row["accuracy"], 3)])
    lines += [markdown(rows), ""]
    detectable = [f"{s.upper()} detectable" for s in scores]
    for against in REFERENCES:
        part = [c for c in analysis["comparisons"] if c["against"] == against and not c.get("own")]
        if not part:
            continue
        title = "CE fine-tuned (the same protocol)" if against == "ce" else "the CE base model (the paper's CE column)"
        lines += [f"Per-seed change of the set size against {title}, mean [{T_LEVEL:.0%} t interval] over the seeds "
                  "(negative: smaller sets; n.s.: the interval holds 0); detectable: the smallest change these seeds detect with 80% power.", ""]
        rows = [["arm", *[s.upper() for s in scores], *detectable]]
        for arm in dict.fromkeys(c["arm"] for c in part):
            mine = {c["score"]: c for c in part if c["arm"] == arm}
            rows.append([arm, *[interval_text(mine[s]) for s in scores], *[detectable_text(mine[s]) for s in scores]])
        lines += [markdown(rows), ""]
    own = [c for c in analysis["comparisons"] if c.get("own")]
    if own:
        lines += [f"The study's own comparisons: per-seed change of the first arm's set size against the second's, mean [{T_LEVEL:.0%} t interval]; "
                  "detectable as above.", ""]
        rows = [["arm", "against", *[s.upper() for s in scores], *detectable]]
        for arm, against in dict.fromkeys((c["arm"], c["against"]) for c in own):
            mine = {c["score"]: c for c in own if c["arm"] == arm and c["against"] == against}
            rows.append([arm, against, *[interval_text(mine[s]) for s in scores], *[detectable_text(mine[s]) for s in scores]])
        lines += [markdown(rows), ""]
    if analysis.get("batch"):
        batch = analysis["batch"]
        first, last = batch["batches"][0], batch["batches"][-1]
        lines += [f"The batch-size prediction: ConfTr's set size over DPSM's per seed, 100 (ConfTr - DPSM) / ConfTr, mean [{T_LEVEL:.0%} t interval], "
                  f"at each batch; its change from batch {last} to batch {first} per seed; the quantile errors at the last epoch "
                  "(DPSM \\|q - Q_n\\|, ConfTr's mean \\|Q_batch - Q_n\\|).", ""]
        rows = [["score", *[f"gap at batch {b}" for b in batch["batches"]], f"gap({first}) - gap({last})", "detectable", "prediction"]]
        for score, part in batch["scores"].items():
            verdict = "holds" if part["holds"] else "contradicted" if part["contradicted"] else "not shown"
            rows.append([score.upper(), *[interval_text(g) for g in part["gaps"]],
                         interval_text(part["difference"]), detectable_text(part["difference"]), verdict])
        lines += [markdown(rows), ""]
        rows = [["batch", "DPSM \\|q - Q_n\\|", "ConfTr \\|Q_batch - Q_n\\|"]]
        rows += [[str(e["batch"]), fmt(e["dpsm_q_error_train"], 4), fmt(e["conftr_q_error_train"], 4)] for e in batch["errors"]]
        lines += [markdown(rows), ""]
    verdict = analysis.get("verdicts", {})
    if "claim" in verdict:
        claim = verdict["claim"]
        lines += [f"**The claim** (searched DPSM at least {CLAIM_MARGIN:g}% smaller than the best searched baseline, HPS and APS, "
                  f"interval below 0, coverage within 1 - alpha ± {COVERAGE_TOLERANCE}): **{claim['verdict']}**. "
                  + "; ".join(f"{s.upper()}: against `{claim[s]['against']}` {interval_text(claim[s])}, detectable {detectable_text(claim[s])}"
                              + ("" if claim[s]["coverage_ok"] else ", coverage outside the tolerance") for s in CRITERION_SCORES) + ".", ""]
    if "mechanism" in verdict:
        mechanism = verdict["mechanism"]
        lines += [f"**The mechanism** (`{mechanism['dpsm']}`, the lambda with DPSM's smaller HPS sets, smaller than `{mechanism['conftr']}` and "
                  f"`{mechanism['cut']}`, HPS and APS, intervals below 0): **{mechanism['verdict']}**.", ""]
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
        # the tex's Algorithm 1 as this project followed it before it trained as the official code does: CE on B1 only, T 0.1, lambda 0.5
        Arm("dpsm_tex", "DPSM, CE on B1 only (the tex), T 0.1, lambda 0.5", {"method": "dpsm", "ce_batch": "half", "sigmoid_temperature": 0.1, "conformal_weight": 0.5}),
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
        return [Arm(f"dpsm_{tag}", f"DPSM, size term on: CE on the whole batch, T 0.1, lambda {weight:g}", {**on, "conformal_weight": weight}),
                Arm(f"conftr_{tag}", f"ConfTr, T 0.1, lambda {weight:g}", {**conftr, "conformal_weight": weight}),
                Arm(f"cut_{tag}", f"CUT, lambda {weight:g}", {"method": "cut", "conformal_weight": weight})]

    arms = [Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0}), Arm("ce", "CE fine-tuned", {"method": "ce"})]
    arms += mechanism(0.5, "l05")
    arms += [Arm("dpsm_l05_ceb1", "DPSM lambda 0.5 T 0.1, CE on B1 only (the tex's change alone)", {**on, "conformal_weight": 0.5, "ce_batch": "half"}),
             Arm("dpsm_l05_t1", "DPSM lambda 0.5, T 1 (the tex's change alone)", {**on, "conformal_weight": 0.5, "sigmoid_temperature": 1.0}),
             Arm("dpsm_l005", "DPSM T 0.1, lambda 0.05 (the tex's change alone)", {**on, "conformal_weight": 0.05})]
    for batch in (32, 512):
        arms += [Arm(f"dpsm_l05_b{batch}", f"DPSM lambda 0.5 T 0.1, batch {batch}", {**on, "conformal_weight": 0.5, "batch_size": batch}),
                 Arm(f"conftr_l05_b{batch}", f"ConfTr lambda 0.5 T 0.1, batch {batch}", {**conftr, "conformal_weight": 0.5, "batch_size": batch})]
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
SHARED_WITH_THE_SWEEP = ("dataset", "alpha", "model", "init", "base_epochs", "base_lr", "base_batch_size", "base_milestones", "epochs", "batch_size", "milestones", "lr_decay", "lr_schedule")


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
            raise SweepError(f"--searched-from {sweep_dir}: its sweep ran with {name}={stored['base'].get(name)!r}, the study with {ours[name]!r}; "
                             "search with the study's settings")
    if not (sweep_dir / "trials.parquet").is_file():
        raise SweepError(f"--searched-from {sweep_dir}: the sweep has no finished search trials yet (no trials.parquet)")
    arms = []
    for method in SEARCHED_METHODS:
        if method in stored.get("methods", ()):
            overrides = best_overrides(SimpleNamespace(grid=False), sweep_dir, method, log)
            if overrides is not None:
                arms.append(Arm(f"searched_{method}", f"{METHOD_TITLES[method]}, searched ({stored['trials']} Optuna trials)", {"method": method, **overrides}))
    if not arms:
        raise SweepError(f"--searched-from {sweep_dir}: none of {', '.join(SEARCHED_METHODS)} has a search trial that finished")
    return tuple(arms)


def shortened(arms: tuple[Arm, ...], epochs: int, milestones: tuple[int, ...]) -> tuple[Arm, ...]:
    """The arms with every trained arm cut to ``epochs`` (smoke runs and CI)."""
    return tuple(arm if arm.settings.get("epochs") == 0 else Arm(arm.name, arm.title, {**arm.settings, "epochs": epochs, "milestones": milestones})
                 for arm in arms)


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

    from dpsm_ray.sweep.spec import ResultsDirUnusable, SweepError
    from dpsm_ray.config import ConfigError
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
    add("--searched-from", metavar="SWEEP_DIR", help="add the searched arms: each method of this finished Optuna sweep (run with the study's dataset, "
                                                    "alpha and schedule) at the configuration its search picked, re-trained with every seed")
    add("--report-from", metavar="FOLDER", help="print the study's tables from its compact results (a study's compact/ folder, e.g. the copy under "
                                                "docs/results/) and exit: nothing is trained")
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
    if args.searched_from:  # after the fixed arms, whatever --arms keeps
        from dpsm_ray.sweep.spec import SweepError

        expected = TrainConfig.from_dict({**common, **({"epochs": definition["quick"]["epochs"], "milestones": definition["quick"]["milestones"]} if args.quick else {})})
        try:
            searched = searched_arms(Path(args.searched_from), expected, log=lambda line: print(line, flush=True))
        except SweepError as error:
            parser.exit(2, f"{prog}: error: {error}\n")
        arms = (*arms, *(shortened(searched, definition["quick"]["epochs"], definition["quick"]["milestones"]) if args.quick else searched))
    seeds = args.seeds or (definition["quick"]["seeds"] if args.quick else definition["seeds"])
    if seeds < 2:
        parser.error(f"--seeds must be an integer >= 2 (the intervals are over seeds); got {seeds}")
    try:
        config = TrainConfig.from_dict(common)
        study = Study(name=f"{definition.get('prefix', 'fidelity')}-{args.dataset}", common=config, arms=arms, seeds=tuple(range(config.seed, config.seed + seeds)),
                      concurrency=args.concurrency or definition.get("concurrency", 1),
                      trial_resources=(("cpu", config.cpus_per_worker), *((("gpu", config.gpus_per_worker),) if config.gpus_per_worker else ())),
                      address=args.address, comparisons=tuple(definition.get("comparisons", ())), batch_pairs=tuple(definition.get("batch_pairs", ())),
                      mechanism=tuple(definition.get("mechanism", ())))
        for arm in study.arms:
            study.arm_config(arm)
    except ConfigError as error:
        parser.exit(2, f"{prog}: error: {error}\n")
    if args.report_from:
        try:
            evals, runs, arms = read_compact(Path(args.report_from))
            print(markdown_report(analyse_tables(dataclasses.replace(study, arms=arms), evals, runs)))
        except FileNotFoundError as error:
            parser.exit(2, f"{prog}: error: {error}\n")
        return 0
    out = Path(args.out or f"results/{definition.get('prefix', 'fidelity')}-{args.dataset}{'-quick' if args.quick else ''}")
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
