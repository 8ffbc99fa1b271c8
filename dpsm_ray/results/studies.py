"""A study's analysis: its arms, the compact results it commits, the tables of ``fidelity.md``,
and the verdicts of the decisive test's criterion (docs/fidelity.md) -- computed from the Parquet
files of a study (``dpsm_ray/sweep/study.py`` runs them) or from its committed compact results.

Arms are compared per seed: the percent change of the mean set size against CE fine-tuned and
against the base model, with a Student t interval over the seeds -- the seeds are the independent
replicates, a model's re-splits are not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from dpsm_ray.cards import BASE_MODEL, REFERENCE_METHOD, score_names
from dpsm_ray.config import TrainConfig
from dpsm_ray.storage.layout import BASE_MODELS, Results
from dpsm_ray.results.runs import COMPACT_RUNS, GRADIENTS, LIKE_FOR_LIKE, LIKE_FOR_LIKE_D1, model_rows
from dpsm_ray.results.stats import T_LEVEL, paired_change, per_seed_change, summary

_REFERENCES = (REFERENCE_METHOD, BASE_MODEL)  # every arm is compared with CE fine-tuned (the arm "ce") and with the base model


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
    # the mechanism criterion's (DPSM arm, the arms it must beat ...) at each setting: ConfTr's and CUT's in
    # the decisive test and round two, CUT's alone in round three
    mechanism: tuple[tuple[str, ...], ...] = ()
    # the claim's arms: the claimant (searched DPSM), then the baselines it must beat (searched CE, ConfTr and CUT);
    # its rule (CLAIM_RULES), and the seeds it reads a mean change within (round three's two backbones)
    claim: tuple[str, ...] = ()
    claim_rule: str = "decisive"
    seed_groups: tuple[tuple[int, ...], ...] = ()

    def arm_config(self, arm: Arm, results: Path | None = None) -> TrainConfig:
        """``arm``'s configuration (seed 0), with the base-model cache of ``results``; validated.  Every
        seed and arm cuts one data split: the common ``split_seed`` where set (round three's seeds 5-9,
        on a second backbone, cut seed 0's), else the study's first seed."""
        split = self.common.seed if self.common.split_seed is None else self.common.split_seed
        values = {**self.common.to_dict(), **arm.settings, "split_seed": split, "evaluate_test": True}
        if results is not None:
            values["cache_dir"] = str(results / BASE_MODELS)
        return TrainConfig.from_dict(values).with_absolute_paths()

    def describe(self) -> dict:
        return {"name": self.name, "common": self.common.to_dict(), "seeds": list(self.seeds),
                "arms": {arm.name: json.loads(json.dumps(arm.settings, default=list)) for arm in self.arms}}


# ----------------------------------------------------------------------------- the analysis

# The compact results of a study (``RESULTS/compact/``, small enough to commit beside the doc that
# quotes them): every model's evaluation rows, and one row per model of its quantile diagnostics.
COMPACT_EVALS = ("stage", "seed", "score", "split", "set_size", "coverage", "covgap", "accuracy")
COMPACT_FAILED = ("stage", "seed", "error")  # the trials that ended without a model (a diverged loss, a crash)


def _write_compact(study: Study, results: Path) -> Path:
    """``results/compact/``: ``evals.csv`` and ``runs.csv`` from the study's Parquet files,
    ``failed.csv`` (each trial that ended without a model, with its error) and ``arms.json`` (each
    arm's name, title and settings, in order) -- what ``analyse_tables`` reads, so the tables
    regenerate from a committed copy exactly as from the whole directory."""
    import pandas as pd

    from dpsm_ray.files import write_json, write_text
    from dpsm_ray.results.tables import calibration_rows  # pandas: not at import, the sweep's front door reads this module

    reader = Results(results)
    evals = calibration_rows(reader.evals)  # the criteria are of marginal sets
    runs = model_rows(evals, reader.epochs)
    evals = evals[list(COMPACT_EVALS)].sort_values(["stage", "seed", "score", "split"])
    failed = pd.DataFrame(columns=list(COMPACT_FAILED))
    if not reader.trials.empty:
        trials = reader.trials
        failed = trials[trials.status == "failed"][list(COMPACT_FAILED)].sort_values(["stage", "seed"])
    folder = results / "compact"
    folder.mkdir(exist_ok=True)
    for name, table in (("evals", evals), ("runs", runs), ("failed", failed)):
        write_text(folder / f"{name}.csv", table.to_csv(index=False, float_format="%.17g"))
    write_json(
        folder / "arms.json",
        [{"name": arm.name, "title": arm.title, "settings": json.loads(json.dumps(arm.settings, default=list))} for arm in study.arms],
    )
    return folder


def read_compact(folder: Path):
    """The evaluation rows, the per-model rows, the arms and the failed trials of a study's compact
    results (a folder written before ``failed.csv`` existed had none)."""
    import pandas as pd

    missing = [name for name in ("evals.csv", "runs.csv", "arms.json") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} holds no study results ({', '.join(missing)} missing): pass a study's compact/ folder")
    arms = tuple(Arm(arm["name"], arm["title"], arm["settings"]) for arm in json.loads((folder / "arms.json").read_text()))
    failed = pd.read_csv(folder / "failed.csv") if (folder / "failed.csv").is_file() else pd.DataFrame(columns=list(COMPACT_FAILED))
    return pd.read_csv(folder / "evals.csv"), pd.read_csv(folder / "runs.csv"), arms, failed


def read_league_as_study(folder: Path):
    """A league's compact copy read as a study's (``read_compact``'s four, then the
    league's alpha), so that a study's criterion judges the league's searches (round two on
    Fashion-MNIST and fonts, docs/fidelity.md): each method's re-trained pick is the arm
    ``searched_<method>``, the CE base model ``base``.  The league keeps no CovGap (NaN here); its
    per-model diagnostics come from ``league-runs.csv`` where the copy has one."""
    import pandas as pd

    from dpsm_ray.results.league import read_league_compact
    from dpsm_ray.results.tables import method_name, method_order, ordered

    folder = Path(folder)
    evals, failed, alpha, _, _ = read_league_compact(folder)

    def arm_of(method: str) -> str:
        return "base" if method == BASE_MODEL else f"searched_{method}"

    arms = tuple(
        Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": BASE_MODEL}) if method == BASE_MODEL
        else Arm(arm_of(method), f"{method_name(method)}, searched (the league's pick)", {"method": method})
        for method in ordered(sorted(set(evals.method)), method_order())
    )
    evals = evals.assign(stage=evals.method.map(arm_of), covgap=math.nan)[list(COMPACT_EVALS)]
    failed = failed.assign(stage=failed.method.map(arm_of))[list(COMPACT_FAILED)]
    runs = pd.DataFrame(columns=list(COMPACT_RUNS))
    if (folder / "league-runs.csv").is_file():
        runs = pd.read_csv(folder / "league-runs.csv")
        runs = runs.assign(stage=runs.method.map(arm_of)).drop(columns="method")
    return evals, runs, arms, failed, float(alpha)


def read_study_folders(folders) -> tuple:
    """The results of one or more folders read as one study's (``read_compact``'s four, then each
    folder's alpha, None for a study's): each folder a study's compact results or a league's copy
    (``read_league_as_study``) -- round two on fonts reads its own sharp arms and the league's
    searches together.  An arm in two folders is kept once if its evaluation rows are the same in
    both (the same models), and its seeds are joined if no seed is in both (round three's two
    backbones: seeds 0-4 and 5-9 of each arm, two studies); ValueError naming it and both folders
    otherwise."""
    import pandas as pd

    evals, runs, failed, arms, alphas, source = [], [], [], [], [], {}
    for folder in map(Path, folders):
        if (folder / "league-evals.csv").is_file():
            part_evals, part_runs, part_arms, part_failed, alpha = read_league_as_study(folder)
        else:
            (part_evals, part_runs, part_arms, part_failed), alpha = read_compact(folder), None
        alphas.append(alpha)
        mine = []  # the arms this folder adds (or adds seeds to), its rows in its own order
        for arm in part_arms:
            rows = part_evals[part_evals.stage == arm.name]
            if arm.name in source:
                first, kept = source[arm.name]
                if set(rows.seed) & set(kept.seed):
                    if not _rows_equal(rows, kept):
                        raise ValueError(f"arm {arm.name} is in {first} and in {folder} with different evaluation rows: "
                                         "they are not the same models; report them apart")
                    continue
                source[arm.name] = (first, pd.concat([kept, rows]))  # other seeds of the same arm
            else:
                source[arm.name] = (folder, rows)
                arms.append(arm)
            mine.append(arm.name)
        evals.append(part_evals[part_evals.stage.isin(mine)])
        runs.append(part_runs[part_runs.stage.isin(mine)])
        failed.append(part_failed[part_failed.stage.isin(mine)])
    return (pd.concat(evals, ignore_index=True), pd.concat(runs, ignore_index=True), tuple(arms),
            pd.concat(failed, ignore_index=True), alphas)


def _rows_equal(one, other) -> bool:
    """The same evaluation rows (set sizes, coverages, accuracies of each seed, score and re-split);
    a league keeps no CovGap, so that column is left out."""
    keys, values = ["stage", "seed", "score", "split"], ["set_size", "coverage", "accuracy"]
    one, other = (frame[keys + values].sort_values(keys).reset_index(drop=True) for frame in (one, other))
    return one.shape == other.shape and bool((one == other).all().all())


def analyse(study: Study, results: Path) -> dict:
    """Write the compact results, and ``fidelity.json`` / ``fidelity.md`` from them."""
    from dpsm_ray.files import write_json, write_text

    evals, runs, _, failed = read_compact(_write_compact(study, results))
    analysis = analyse_tables(study, evals, runs, failed)
    write_json(results / "fidelity.json", analysis)
    write_text(results / "fidelity.md", markdown_report(analysis) + "\n")
    return analysis


def analyse_tables(study: Study, evals, runs, failed=None) -> dict:
    """The tables of ``fidelity.md``: each arm's metrics (and its trials that ended without a model,
    from ``failed``), its per-seed changes against CE and the base model and in the study's own
    comparisons, the batch-size gaps, and the quantile diagnostics of the arms that learn one."""
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
    comparisons = [paired_change(evals, arm, against, score) for against in _REFERENCES if against in names
                   for arm in names if arm != against for score in scores]
    comparisons += [{**paired_change(evals, arm, against, score), "own": True} for arm, against in study.comparisons
                    if arm in names and against in names for score in scores]
    diagnostics = []
    for arm in present:
        part = runs[runs.stage == arm.name]
        if part.empty or part.q_error_train.isna().all():  # no quantile the diagnostics read (ConfTS's q is an APS batch threshold)
            continue
        diagnostics.append({
            "arm": arm.name,
            **{c: float(part[c].mean()) for c in ("q", "q_dataset_train", "q_error_train", "train_set_size_q", "val_set_size")},
            "q_error_train_all_epochs": float(part.q_error_train_all_epochs.mean()),
            **{c: float(part[c].mean()) for c in (*LIKE_FOR_LIKE, *LIKE_FOR_LIKE_D1) if c in part},
        })
    gradients = []  # every arm whose loss is CE + a size term, in results that measured it
    for arm in present:
        part = runs[runs.stage == arm.name]
        if set(GRADIENTS) <= set(part.columns) and part.size_grad_norm_first.notna().any():
            gradients.append({"arm": arm.name, **{c: float(part[c].mean()) for c in GRADIENTS}})
    modelled = set(zip(evals.stage, evals.seed))  # a trial that failed once and was trained again has its model
    failures = [] if failed is None else [
        {"arm": str(row.stage), "seed": int(row.seed), "error": str(row.error)}
        for row in failed.itertuples() if (row.stage, row.seed) not in modelled
    ]
    ended = {failure["arm"] for failure in failures}
    named = dict.fromkeys(arm for pair in (*study.comparisons, *study.mechanism) for arm in pair)
    analysis = {
        "study": study.name,
        "dataset": study.common.dataset,
        "alpha": study.common.alpha,
        "seeds": sorted(int(seed) for seed in set(evals.seed)),
        "eval_splits": study.common.eval_splits,
        "table": table,
        "comparisons": comparisons,
        "diagnostics": diagnostics,
        "gradients": gradients,
        "batch": _batch_gaps(study, evals, runs, scores),
        "failed": failures,
        "absent": [arm for arm in named if arm not in names and arm not in ended],  # no model and no failed trial: cut, or run elsewhere
    }
    analysis["verdicts"] = verdicts(study, analysis, evals)
    return analysis


# The pre-registered criterion (docs/fidelity.md, "The decisive test"): the margin DPSM must beat the
# best searched baseline by, and how far from 1 - alpha an arm's coverage may be and still count.
_CLAIM_MARGIN = 5.0
_CRITERION_SCORES = ("hps", "aps")  # the scores the criterion judges (docs/fidelity.md)
COVERAGE_TOLERANCE = 0.005


def _decisive_claim(changes) -> str:
    """The decisive test's and round two's rule: each mean at least 5% below, each interval below 0."""
    if all(c["coverage_ok"] and c["mean"] <= -_CLAIM_MARGIN and c["high"] < 0 for c in changes):
        return "supported"
    return "contradicted" if any(c["low"] > -_CLAIM_MARGIN for c in changes) else "inconclusive"


def _round_three_claim(changes) -> str:
    """Round three's rule (docs/fidelity.md, its criterion): each interval's upper end below -5% and
    the mean change negative within each backbone; of the paper's size if each mean is also below
    -25%; contradicted if an interval's lower end is above -5%."""
    changes = list(changes)
    if all(c["coverage_ok"] and c["high"] < -_CLAIM_MARGIN and all(mean < 0 for mean in c["within"]) for c in changes):
        return "supported, of the paper's size" if all(c["mean"] < -_PAPER_SIZE for c in changes) else "supported"
    return "contradicted" if any(c["low"] > -_CLAIM_MARGIN for c in changes) else "inconclusive"


_PAPER_SIZE = 25.0  # half the paper's 50.0% mean gain on Caltech-101: round three's "of the paper's size"
_CLAIM_RULES = {"decisive": _decisive_claim, "round_three": _round_three_claim}
_CLAIM_TEXT = {
    "decisive": f"searched DPSM at least {_CLAIM_MARGIN:g}% smaller than the best searched baseline, HPS and APS, interval below 0",
    "round_three": (f"searched DPSM's interval against the best searched baseline below -{_CLAIM_MARGIN:g}%, HPS and APS, and "
                    f"its mean change negative within each backbone; of the paper's size if both means are below -{_PAPER_SIZE:g}%"),
}


def _within_mean(evals, arm: str, against: str, score: str, seeds) -> float:
    """The mean per-seed change of ``arm`` against ``against`` over ``seeds`` (NaN if none of them has both)."""
    changes = per_seed_change(evals, arm, against, score)
    changes = changes[changes.index.isin(list(seeds))].dropna()
    return float(changes.mean()) if len(changes) else math.nan


def verdicts(study: Study, analysis: dict, evals) -> dict:
    """The criterion's verdicts, where the study has the arms they need: ``claim`` (searched DPSM
    against the best searched baseline, HPS and APS) and ``mechanism`` (DPSM at the lambda that
    gives it the smaller HPS sets, against ConfTr and CUT at that lambda)."""
    rows = {row["arm"]: row for row in analysis["table"]}

    def covered(arm: str, score: str) -> bool:
        return abs(rows[arm][score]["coverage"] - (1 - study.common.alpha)) <= COVERAGE_TOLERANCE

    result = {}
    claimant, baselines = (study.claim[0], [arm for arm in study.claim[1:] if arm in rows]) if study.claim else (None, [])
    if claimant in rows and baselines and all(s in rows[claimant] for s in _CRITERION_SCORES):
        claim = {}
        for score in _CRITERION_SCORES:
            best = min(baselines, key=lambda arm: rows[arm][score]["set_size"])
            change = paired_change(evals, claimant, best, score)
            claim[score] = {"against": best, **change, "coverage_ok": covered(claimant, score)}
            claim[score]["within"] = [_within_mean(evals, claimant, best, score, seeds) for seeds in study.seed_groups]
        result["claim"] = {**claim, "rule": study.claim_rule, "verdict": _CLAIM_RULES[study.claim_rule](claim.values())}
    triples = [t for t in study.mechanism if set(t) <= set(rows)]
    if triples:
        arm, *others = min(triples, key=lambda t: rows[t[0]]["hps"]["set_size"])
        changes = {f"{score}_{other}": paired_change(evals, arm, other, score) for score in _CRITERION_SCORES for other in others}
        holds = all(c["high"] < 0 for c in changes.values()) and all(covered(arm, score) for score in _CRITERION_SCORES)
        result["mechanism"] = {"arm": arm, "against": others, "changes": changes, "verdict": "holds" if holds else "not shown"}
    return result


def _batch_gaps(study: Study, evals, runs, scores: list[str]) -> dict | None:
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
        result["scores"][score] = {
            "gaps": [{"batch": batch, **summary(gaps[batch].tolist())} for batch, _, _ in pairs],
            "difference": difference,
            "holds": bool(difference["low"] > 0 and all(a >= b for a, b in zip(means, means[1:]))),
            "contradicted": bool(difference["high"] < 0),
        }
    result["errors"] = [
        {
            "batch": batch,
            **{
                f"{name}_q_error_train": float(runs[runs.stage == arm].q_error_train.mean())
                for name, arm in (("learned", dpsm), ("batch", conftr))
            },
        }
        for batch, dpsm, conftr in pairs
    ]
    return result


def _fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def interval_text(change: dict) -> str:
    if change["seeds"] < 2:  # one paired seed (the other arm's failed): a number, no interval
        return "n/a (no seed)" if change["seeds"] == 0 else f"{change['mean']:+.1f}% (1 seed: no interval)"
    marker = "" if change["significant"] else " (n.s.)"
    return f"{change['mean']:+.1f}% [{_fmt(change['low'], 1)}, {_fmt(change['high'], 1)}]{marker}"


def detectable_text(change: dict) -> str:
    return "n/a" if change["seeds"] < 2 else f"±{_fmt(change['detectable'], 1)}%"


def markdown_report(analysis: dict) -> str:
    """A study's analysis as markdown: its arms' table, then each part the analysis holds."""
    scores = [s for s in score_names() if analysis["table"] and s in analysis["table"][0]]
    lines, outside = _arms_table(analysis, scores)
    flagged_arms = {arm for arm, _, _ in outside}

    def mark(arm: str) -> str:
        return f"{arm} (outside)" if arm in flagged_arms else arm

    lines += _lost_lines(analysis)
    lines += _comparison_lines(analysis, scores, mark)
    lines += _batch_lines(analysis)
    lines += _verdict_lines(analysis)
    lines += _diagnostic_lines(analysis, mark)
    lines += _gradient_lines(analysis, mark)
    return "\n".join(lines)


def _arms_table(analysis: dict, scores: list[str]) -> tuple[list[str], list[tuple[str, str, float]]]:
    """The arms' set sizes and coverages, and the (arm, score, coverage) outside the precondition."""
    from dpsm_ray.results.report import markdown

    lines = [f"**{analysis['dataset']}, alpha {analysis['alpha']:g}**: {len(analysis['seeds'])} training seeds x {analysis['eval_splits']} "
             "calibration/test re-splits; set size mean ± std over seeds and re-splits.", ""]
    rows = [["arm", "models", *[f"{s.upper()} size" for s in scores], *[f"{s.upper()} coverage" for s in scores], "accuracy"]]
    seeds = len(analysis["seeds"])  # every seed some arm has a model of
    outside = []  # (arm, score, coverage) outside the criterion's precondition
    for row in analysis["table"]:
        models = str(row["models"]) if row["models"] == seeds else f"{row['models']} of {seeds}"
        sizes = [f"{_fmt(row[s]['set_size'])} ± {_fmt(row[s]['set_size_std'])}" for s in scores]
        flagged = [s for s in scores if abs(row[s]["coverage"] - (1 - analysis["alpha"])) > COVERAGE_TOLERANCE]
        outside += [(row["arm"], s, row[s]["coverage"]) for s in flagged]
        coverages = [_fmt(row[s]["coverage"], 3) + (" (outside)" if s in flagged else "") for s in scores]
        rows.append([f"{row['title']} (`{row['arm']}`)", models, *sizes, *coverages, _fmt(row["accuracy"], 3)])
    lines += [markdown(rows), ""]
    if outside:
        said = "; ".join(f"`{arm}` {score.upper()} {coverage:.4f}" for arm, score, coverage in outside)
        lines += [f"Outside the coverage precondition (1 - alpha ± {COVERAGE_TOLERANCE}: such a set size counts as smaller in no verdict; "
                  f"marked (outside) in every table): {said}.", ""]
    return lines, outside


def _lost_lines(analysis: dict) -> list[str]:
    """The trials that ended without a model, and the arms the comparisons name that are absent."""
    lines = []
    if analysis["failed"]:
        grouped: dict[tuple[str, str], list[int]] = {}
        for failure in analysis["failed"]:
            grouped.setdefault((failure["arm"], failure["error"]), []).append(failure["seed"])
        said = [f"`{arm}` seed{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}: {error}"
                for (arm, error), lost in grouped.items()]
        lines += [f"Trials that ended without a model (in no table or comparison): {'; '.join(said)}.", ""]
    if analysis.get("absent"):
        lines += [f"Arms the study's comparisons name that are not in these results (in no table, comparison or verdict): "
                  f"{', '.join(f'`{arm}`' for arm in analysis['absent'])}.", ""]
    return lines


def _comparison_lines(analysis: dict, scores: list[str], mark) -> list[str]:
    """Each arm against the references, then the study's own comparisons."""
    from dpsm_ray.results.report import markdown

    lines = []
    detectable = [f"{s.upper()} detectable" for s in scores]
    for against in _REFERENCES:
        part = [c for c in analysis["comparisons"] if c["against"] == against and not c.get("own")]
        if not part:
            continue
        title = "CE fine-tuned (the same protocol)" if against == REFERENCE_METHOD else "the CE base model (the paper's CE column)"
        lines += [
            (
                f"Per-seed change of the set size against {title}, mean [{T_LEVEL:.0%} t interval] over the seeds "
                "(negative: smaller sets; n.s.: the interval holds 0); detectable: the smallest change these seeds detect with 80% power."
            ),
            "",
        ]
        rows = [["arm", *[s.upper() for s in scores], *detectable]]
        for arm in dict.fromkeys(c["arm"] for c in part):
            mine = {c["score"]: c for c in part if c["arm"] == arm}
            rows.append([mark(arm), *[interval_text(mine[s]) for s in scores], *[detectable_text(mine[s]) for s in scores]])
        lines += [markdown(rows), ""]
    own = [c for c in analysis["comparisons"] if c.get("own")]
    if own:
        lines += [
            (
                f"The study's own comparisons: per-seed change of the first arm's set size against the second's, mean [{T_LEVEL:.0%} t"
                " interval]; detectable as above."
            ),
            "",
        ]
        rows = [["arm", "against", *[s.upper() for s in scores], *detectable]]
        for arm, against in dict.fromkeys((c["arm"], c["against"]) for c in own):
            mine = {c["score"]: c for c in own if c["arm"] == arm and c["against"] == against}
            rows.append([mark(arm), mark(against), *[interval_text(mine[s]) for s in scores], *[detectable_text(mine[s]) for s in scores]])
        lines += [markdown(rows), ""]
    return lines


def _batch_lines(analysis: dict) -> list[str]:
    """The batch-size prediction, where the study makes it."""
    from dpsm_ray.results.report import markdown

    lines = []
    if analysis.get("batch"):
        batch = analysis["batch"]
        first, last = batch["batches"][0], batch["batches"][-1]
        lines += [
            (
                f"The batch-size prediction: ConfTr's set size over DPSM's per seed, 100 (ConfTr - DPSM) / ConfTr, mean [{T_LEVEL:.0%} t"
                f" interval], at each batch; its change from batch {last} to batch {first} per seed; the quantile errors at the last epoch"
                " (DPSM \\|q - Q_n\\|, ConfTr's mean \\|Q_batch - Q_n\\|)."
            ),
            "",
        ]
        rows = [["score", *[f"gap at batch {b}" for b in batch["batches"]], f"gap({first}) - gap({last})", "detectable", "prediction"]]
        for score, part in batch["scores"].items():
            verdict = "holds" if part["holds"] else "contradicted" if part["contradicted"] else "not shown"
            rows.append([score.upper(), *[interval_text(g) for g in part["gaps"]],
                         interval_text(part["difference"]), detectable_text(part["difference"]), verdict])
        lines += [markdown(rows), ""]
        rows = [["batch", "DPSM \\|q - Q_n\\|", "ConfTr \\|Q_batch - Q_n\\|"]]
        rows += [[str(e["batch"]), _fmt(e["learned_q_error_train"], 4), _fmt(e["batch_q_error_train"], 4)] for e in batch["errors"]]
        lines += [markdown(rows), ""]
    return lines


def _verdict_lines(analysis: dict) -> list[str]:
    """The claim's and the mechanism's verdicts."""
    lines = []
    verdict = analysis.get("verdicts", {})
    if "claim" in verdict:
        claim = verdict["claim"]
        rule = _CLAIM_TEXT[claim.get("rule", "decisive")]

        def within(change: dict) -> str:
            means = change.get("within") or []
            text = [f"{_fmt(mean, 1)}%" if math.isfinite(mean) else "n/a (no seed)" for mean in means]
            return f", within each backbone {' and '.join(text)}" if means else ""

        lines += [
            f"**The claim** ({rule}, coverage within 1 - alpha ± {COVERAGE_TOLERANCE}): **{claim['verdict']}**. "
            + "; ".join(
                f"{s.upper()}: against `{claim[s]['against']}` {interval_text(claim[s])}{within(claim[s])}, "
                f"detectable {detectable_text(claim[s])}"
                + ("" if claim[s]["coverage_ok"] else ", coverage outside the tolerance")
                for s in _CRITERION_SCORES
            )
            + ".",
            "",
        ]
    if "mechanism" in verdict:
        mechanism = verdict["mechanism"]
        lines += [
            (
                f"**The mechanism** (`{mechanism['arm']}`, of the mechanism's settings the one with DPSM's smallest HPS sets, smaller"
                f" than {' and '.join(f'`{arm}`' for arm in mechanism['against'])}, HPS and APS, intervals below 0):"
                f" **{mechanism['verdict']}**."
            ),
            "",
        ]
    return lines


def _diagnostic_lines(analysis: dict, mark) -> list[str]:
    """The quantile diagnostics, and the quantile error like for like."""
    from dpsm_ray.results.report import markdown

    lines = []
    if analysis["diagnostics"]:
        lines += [
            (
                "Quantile diagnostics at the last epoch (mean over seeds): the learned q (DPSM) or batch tau (ConfTr), Q_n of the training"
                " split, \\|q - Q_n\\| (and its mean over all epochs), the training set size at q, the validation set size."
            ),
            "",
        ]
        rows = [["arm", "q", "Q_n train", "\\|q - Q_n\\|", "\\|q - Q_n\\| all epochs", "train size at q", "val size"]]
        rows += [[mark(d["arm"]), _fmt(d["q"], 4), _fmt(d["q_dataset_train"], 4), _fmt(d["q_error_train"], 4),
                  _fmt(d["q_error_train_all_epochs"], 4), _fmt(d["train_set_size_q"]), _fmt(d["val_set_size"])]
                 for d in analysis["diagnostics"]]
        lines += [markdown(rows), ""]
    like = [d for d in analysis["diagnostics"] if not math.isnan(d.get("q_error_train_mode", math.nan))]
    if like:
        lines += [
            (
                "The quantile error like for like (last epoch, mean over seeds): against Q_n of the training scores in eval mode (as above)"
                " and of the scores training sees -- augmented, in train mode, which DPSM's q is learned from; ConfTr's batch taus"
                " recomputed from each."
            ),
            "",
        ]
        rows = [["arm", "\\|q - Q_n\\| eval mode", "\\|q - Q_n\\| train mode", "Q_n eval mode", "Q_n train mode"]]
        rows += [[mark(d["arm"]), _fmt(d["q_error_train"], 4), _fmt(d["q_error_train_mode"], 4), _fmt(d["q_dataset_train"], 4),
                  _fmt(d["q_dataset_train_mode"], 4)] for d in like]
        if any(not math.isnan(d.get("q_error_train_mode_d1", math.nan)) for d in like):  # results since D1's were measured
            rows[0] += ["\\|q - Q_n\\| train mode, D1", "Q_n train mode, D1"]
            for row, d in zip(rows[1:], like):
                row += [_fmt(d.get("q_error_train_mode_d1", math.nan), 4), _fmt(d.get("q_dataset_train_mode_d1", math.nan), 4)]
        lines += [markdown(rows), ""]
    return lines


def _gradient_lines(analysis: dict, mark) -> list[str]:
    """Whether the size term is active: the gradient norms."""
    from dpsm_ray.results.report import markdown

    lines = []
    if analysis.get("gradients"):
        lines += [
            (
                "Is the size term active? The gradient norm of CE and of lambda x L_c at the first step and at the start of the middle"
                " epoch, on that step's batch (mean over seeds), and their ratio."
            ),
            "",
        ]
        rows = [["arm", "CE first", "size first", "size / CE first", "CE middle", "size middle", "size / CE middle"]]
        for g in analysis["gradients"]:
            ratio = lambda when: _fmt(g[f"size_grad_norm_{when}"] / g[f"ce_grad_norm_{when}"], 3) if g[f"ce_grad_norm_{when}"] else "n/a"
            rows.append([mark(g["arm"]), _fmt(g["ce_grad_norm_first"], 3), _fmt(g["size_grad_norm_first"], 3), ratio("first"),
                         _fmt(g["ce_grad_norm_middle"], 3), _fmt(g["size_grad_norm_middle"], 3), ratio("middle")])
        lines += [markdown(rows), ""]
    return lines
