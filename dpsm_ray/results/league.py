"""The league (docs/league.md): every method a sweep searched and re-trained, ranked by its sets,
each against CE fine-tuned per seed, with the criterion's verdict.

From a sweep's final rows (``Results(DIR).final("evals")``) or from its compact copy
(``compact/league-evals.csv`` and ``league-failed.csv``, small enough to commit): the tables
regenerate from either, to the same text.  The copy also holds ``league-search.csv``, the record of
every search trial (its searched values, validation metrics, feasibility, status and error), so a
reader can check each pick without the sweep's folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dpsm_ray.cards import BASE_MODEL, REFERENCE_METHOD
from dpsm_ray.storage.layout import Results
from dpsm_ray.results.stats import T_LEVEL, paired_change
from dpsm_ray.results.runs import model_rows
from dpsm_ray.results.tables import calibration_rows, method_name

_REFERENCE = REFERENCE_METHOD  # every method is compared with CE fine-tuned, searched as carefully
SCORES = ("hps", "aps", "raps")
_DECIDING = ("hps", "aps")  # the criterion's scores
COVERAGE_TOLERANCE = 0.005  # coverage outside 1 - alpha +- this does not count as smaller
_MARGIN = -5.0  # percent: a gain that matters (the size the DPSM paper reports outside Caltech-101)
COMPACT_EVALS = ("method", "seed", "score", "split", "set_size", "coverage", "accuracy")
COMPACT_FAILED = ("method", "seed", "error")


def write_league_compact(results: str | Path) -> Path:
    """``RESULTS/compact/league-{evals,failed,search,runs}.csv`` and ``league.json`` from the sweep's
    final rows, its search trials and its final models' epochs (``league-runs.csv``: one row per
    model, the quantile and gradient diagnostics a study keeps, ``runs.model_rows``)."""
    from dpsm_ray.files import write_json, write_text
    from dpsm_ray.results.provenance import search_picks, write_search_record  # pandas: not at import (the sweep's front door)

    reader = Results(results)
    final, trials = calibration_rows(reader.final("evals")), reader.final("trials")  # the league ranks marginal sets
    if final.empty:
        raise ValueError(f"{reader.directory} holds no final marginal evaluation rows: the league ranks marginal sets "
                         f"(a sweep with --eval-calibrations marginal, its default)")
    evals = final[list(COMPACT_EVALS)].sort_values(["method", "seed", "score", "split"])
    failed = trials[trials.status == "failed"] if not trials.empty else trials
    folder = reader.directory / "compact"
    folder.mkdir(exist_ok=True)
    write_text(folder / "league-evals.csv", evals.to_csv(index=False, float_format="%.17g"))
    failed = failed.reindex(columns=list(COMPACT_FAILED)).sort_values(["method", "seed"])
    write_text(folder / "league-failed.csv", failed.to_csv(index=False))
    dataset = (reader.sweep or {}).get("base", {}).get("dataset")
    write_search_record(reader, folder / "league-search.csv")
    epochs = reader.final("epochs")
    if not epochs.empty:
        runs = model_rows(final, epochs, by="method").sort_values(["method", "seed"])
        write_text(folder / "league-runs.csv", runs.to_csv(index=False, float_format="%.17g"))
    # each method's pick, counted from 1 as the search record counts its trials
    picks = {method: int(pick.trial_index) + 1 for method, pick in sorted(search_picks(reader.trials, reader.sweep).items())}
    write_json(folder / "league.json", {"dataset": dataset, "alpha": float(final.alpha.iloc[0]), "picks": picks})
    return folder


def read_league_compact(folder: str | Path):
    """``(evals, failed, alpha, dataset, search)`` from a compact copy, ``search`` the record of the
    search trials with each method's pick (``(DataFrame, {method: trial})``; None in a copy without
    ``league-search.csv``); FileNotFoundError naming what is missing."""
    import pandas as pd

    folder = Path(folder)
    for name in ("league-evals.csv", "league-failed.csv", "league.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: give a league's compact/ folder (RESULTS/compact, or its copy under "
                                    "docs/results/)")
    meta = json.loads((folder / "league.json").read_text())
    record = folder / "league-search.csv"
    search = (pd.read_csv(record), meta.get("picks", {})) if record.is_file() else None
    return pd.read_csv(folder / "league-evals.csv"), pd.read_csv(folder / "league-failed.csv"), meta["alpha"], meta["dataset"], search


def verdict(changes: dict, coverage: float, alpha: float) -> str:
    """The criterion's verdict of one method against CE (docs/league.md)."""
    if not abs(coverage - (1 - alpha)) <= COVERAGE_TOLERANCE:
        return f"coverage {coverage:.4f} outside {1 - alpha:g} +- {COVERAGE_TOLERANCE:g}: not counted"
    deciding = [changes[score] for score in _DECIDING]
    if any(math.isnan(c["high"]) for c in deciding):
        return "no interval (fewer than two seeds)"
    if any(c["low"] > 0 for c in deciding):
        return "worse than CE"
    if all(c["high"] < _MARGIN for c in deciding):
        return "beats CE, by a margin that matters"
    if all(c["high"] < 0 for c in deciding):
        return "beats CE"
    return "ties CE at this resolution"


def analyse_league(evals, failed, alpha: float, dataset: str | None = None, search=None) -> dict:
    """Each method's sets, coverage and accuracy, its change against CE per seed (t interval and
    detectable effect) and its verdict; the methods ordered by mean HPS set size; the answer; and,
    given ``search`` (``read_league_compact``'s), each method's search: its trials and their
    outcomes, and its pick with the values it searched."""
    methods = sorted(set(evals.method))
    rows = []
    for method in methods:
        mine = evals[evals.method == method]
        row = {
            "method": method,
            "models": int(mine.seed.nunique()),
            "coverage": float(mine[mine.score == "hps"].coverage.mean()),
            "accuracy": float(mine[mine.score == "hps"].accuracy.mean()),
            "size": {s: (float(mine[mine.score == s].set_size.mean()), float(mine[mine.score == s].set_size.std()))
                     for s in SCORES if (mine.score == s).any()},
        }
        if method not in (_REFERENCE, BASE_MODEL) and _REFERENCE in methods:
            row["changes"] = {s: paired_change(evals, method, _REFERENCE, s, by="method") for s in SCORES if (mine.score == s).any()}
            row["verdict"] = verdict(row["changes"], row["coverage"], alpha)
        rows.append(row)
    ranked = sorted((r for r in rows if r["method"] != BASE_MODEL), key=lambda r: r["size"]["hps"][0])
    winners = [r for r in ranked if r.get("verdict", "").startswith("beats")]
    answer = (f"{method_name(winners[0]['method'])} (the smallest HPS sets among the methods that beat CE)" if winners
              else "CE fine-tuned, tuned as carefully, is as good as any of them here" if _REFERENCE in methods
              else "none here: these results hold no CE fine-tuned to compare with (--ce-from adds another league's)")
    failures = {} if failed is None or failed.empty else failed.groupby("method").size().to_dict()
    return {"dataset": dataset, "alpha": alpha, "ranked": ranked, "base": next((r for r in rows if r["method"] == BASE_MODEL), None),
            "failed": {m: int(n) for m, n in failures.items()}, "answer": answer,
            "searches": [] if search is None else searches(*search, order=[r["method"] for r in ranked])}


def searches(record, picks: dict, order: list[str]) -> list[dict]:
    """Per searched method (in ``order``, then any other): its trials, how many ended feasible,
    infeasible, stopped early or failed, and its pick (trial, validation metrics, searched values)."""
    from dpsm_ray.results.provenance import COMPACT_SEARCH, outcome_counts

    knobs = [c for c in record.columns if c not in (*COMPACT_SEARCH, "error")]
    methods = [m for m in order if m in set(record.method)] + sorted(set(record.method) - set(order))
    rows = []
    for method in methods:
        mine = record[record.method == method]
        row = {"method": method, "trials": len(mine), **outcome_counts(mine), "pick": None}
        chosen = mine[mine.trial == picks.get(method)]
        if not chosen.empty:
            pick = chosen.iloc[0]
            row["pick"] = {"trial": int(pick.trial), "val_set_size": float(pick.val_set_size), "val_coverage": float(pick.val_coverage),
                           "values": {k: pick[k] for k in knobs if not (isinstance(pick[k], float) and math.isnan(pick[k]))}}
        rows.append(row)
    return rows


def league_section(evals, trials, alpha: float, sweep: dict | None) -> list[str]:
    """report.md's ``## The league`` for a sweep that re-trained CE and at least two other methods
    (docs/league.md), else nothing."""
    trained = set(evals.method) - {BASE_MODEL} if not evals.empty else set()
    if _REFERENCE not in trained or len(trained) < 3:
        return []
    failed = trials[(trials.stage == "final") & (trials.status == "failed")] if "stage" in trials else trials.iloc[:0]
    analysis = analyse_league(evals, failed, alpha, (sweep or {}).get("base", {}).get("dataset"))
    return ["## The league", "", league_markdown(analysis).rstrip(), "", "Its criterion and how to read it: docs/league.md.", ""]


def against_other_ce(evals, study_evals, alpha: float, arm: str = "searched_ce") -> dict:
    """Each league method against another study's CE (``arm`` of a study's compact evaluation rows,
    e.g. the decisive test's 8-trial searched CE), paired per seed over the seeds whose CE base
    models the two share -- their ``base`` rows equal to the last digit, so each pair fine-tuned
    from one model -- with the league's criterion's verdict.  ValueError when no seed is shared."""
    import pandas as pd

    shared = shared_base_seeds(evals, study_evals, column="stage")
    if not shared or not (study_evals.stage == arm).any():
        raise ValueError(f"the study shares no CE base model with the league (equal base rows), or has no arm {arm}")
    reference = study_evals[study_evals.stage == arm].assign(method="other_ce").drop(columns="stage")
    pooled = pd.concat([evals, reference[[c for c in evals.columns if c in reference.columns]]])
    pooled = pooled[pooled.seed.isin(shared)]
    found = []
    for method in sorted(set(evals.method) - {BASE_MODEL}):
        changes = {score: paired_change(pooled, method, "other_ce", score, by="method") for score in _DECIDING}
        coverage = float(pooled[(pooled.method == method) & (pooled.score == "hps")].coverage.mean())
        found.append({"method": method, "changes": changes, "verdict": verdict(changes, coverage, alpha)})
    return {"arm": arm, "seeds": shared, "rows": found}


def shared_base_seeds(evals, other_evals, column: str = "method") -> list[int]:
    """The seeds whose CE base model the league's ``evals`` and ``other_evals`` (another league's, or
    a study's, whose arms are in ``column="stage"``) share: their base rows equal to the last digit,
    so each pair of their models fine-tunes one model."""

    def base_rows(frame, column: str) -> dict:
        part = frame[frame[column] == BASE_MODEL]
        return {seed: part[part.seed == seed].sort_values(["score", "split"]).set_size.tolist() for seed in sorted(part.seed.unique())}

    mine, theirs = base_rows(evals, "method"), base_rows(other_evals, column)
    return [seed for seed in mine if theirs.get(seed) == mine[seed]]


def with_other_ce(compact: tuple, other: tuple) -> tuple[tuple, list[int]]:
    """A league's compact rows (``read_league_compact``'s) with CE's -- its final models, failures
    and search -- taken from ``other``, another league's that searched CE again (docs/league.md), on
    the seeds whose CE base models the two share (equal base rows, so every pair fine-tunes one
    model): the rows ``analyse_league`` ranks, and those seeds.  ValueError when the two are
    different leagues (dataset, alpha) or share no base model."""
    import pandas as pd

    evals, failed, alpha, dataset, search = compact
    their_evals, their_failed, their_alpha, their_dataset, their_search = other
    if (their_dataset, their_alpha) != (dataset, alpha):
        raise ValueError(f"the other league ran {their_dataset} at alpha {their_alpha:g}, this one {dataset} at alpha {alpha:g}")

    shared = shared_base_seeds(evals, their_evals)
    if not shared or not (their_evals.method == _REFERENCE).any():
        raise ValueError(f"the other league shares no CE base model with this one (equal base rows), or has no {_REFERENCE} rows")

    def swapped(frame, their_frame):
        joined = pd.concat([frame[frame.method != _REFERENCE], their_frame[their_frame.method == _REFERENCE]])
        return joined[joined.seed.isin(shared)] if "seed" in joined else joined

    merged_search = None
    if search is not None and their_search is not None:
        (record, picks), (their_record, their_picks) = search, their_search
        merged_search = (swapped(record, their_record), {**picks, _REFERENCE: their_picks[_REFERENCE]})
    return (swapped(evals, their_evals), swapped(failed, their_failed), alpha, dataset, merged_search), shared


def against_unpaired_ce(evals, other_evals, alpha: float) -> dict:
    """Each league method against another league's CE where the two share no CE base model (so
    nothing pairs a seed with a seed): per method and score, its per-seed mean set sizes against
    that CE's, ``stats.unpaired_change``, with the criterion's words on those intervals."""
    from dpsm_ray.results.stats import unpaired_change

    def per_seed(frame, method: str, score: str) -> list[float]:
        part = frame[(frame.method == method) & (frame.score == score)]
        return part.groupby("seed").set_size.mean().tolist()

    found = []
    for method in sorted(set(evals.method) - {BASE_MODEL}):
        mine = evals[evals.method == method]
        changes = {score: unpaired_change(per_seed(evals, method, score), per_seed(other_evals, _REFERENCE, score)) for score in _DECIDING}
        coverage = float(mine[mine.score == "hps"].coverage.mean())
        size = {score: float(mine[mine.score == score].set_size.mean()) for score in _DECIDING}
        found.append({"method": method, "changes": changes, "verdict": verdict(changes, coverage, alpha), "size": size})
    reference = {score: float(other_evals[(other_evals.method == _REFERENCE) & (other_evals.score == score)].set_size.mean())
                 for score in _DECIDING}
    return {"rows": sorted(found, key=lambda row: row["size"]["hps"]), "reference": reference,
            "seeds": (int(evals.seed.nunique()), int(other_evals[other_evals.method == _REFERENCE].seed.nunique()))}


def against_unpaired_ce_markdown(comparison: dict, source: str) -> str:
    """``against_unpaired_ce``'s table."""
    mine, theirs = comparison["seeds"]
    reference = comparison["reference"]
    header = ["method", *(f"{score.upper()}" for score in _DECIDING), *(f"{score.upper()} vs that CE" for score in _DECIDING),
              "the criterion's words"]
    lines = [f"Each method against CE of {source} (HPS {reference['hps']:.3f}, APS {reference['aps']:.3f}), whose {theirs} seeds were "
             f"fine-tuned from other CE base models than these {mine}: nothing pairs a seed, so each change is of the means over seeds, "
             f"mean [{T_LEVEL:.0%} interval, unpaired: the log ratio's delta-method variance, Welch's degrees of freedom].", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in comparison["rows"]:
        name = method_name(row["method"]) + (" (this league's)" if row["method"] == _REFERENCE else "")
        cells = [name, *(f"{row['size'][s]:.3f}" for s in _DECIDING), *(change_text(row["changes"][s]) for s in _DECIDING), row["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def against_other_ce_markdown(comparison: dict, source: str) -> str:
    """``against_other_ce``'s table, as docs/league.md quotes it."""
    seeds = comparison["seeds"]
    header = ["method", *(f"{score.upper()} vs that CE" for score in _DECIDING), "verdict against it"]
    lines = [f"Each method against `{comparison['arm']}` of {source}, paired per seed over the {len(seeds)} seeds whose CE base "
             f"models the two share (seeds {seeds_text(seeds)}: their base rows are equal), mean [{T_LEVEL:.0%} t interval].", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in comparison["rows"]:
        name = method_name(row["method"]) + (" (this league's, 2 trials)" if row["method"] == _REFERENCE else "")
        lines.append("| " + " | ".join([name, *(change_text(row["changes"][s]) for s in _DECIDING), row["verdict"]]) + " |")
    return "\n".join(lines) + "\n"


def seeds_text(seeds: list[int]) -> str:
    """``1-9``, or ``0, 2, 5`` where the seeds are not consecutive."""
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2:
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def change_text(change: dict) -> str:
    if math.isnan(change["low"]):
        return f"{change['mean']:+.1f}% (no interval)"
    return f"{change['mean']:+.1f}% [{change['low']:+.1f}, {change['high']:+.1f}]"


def league_markdown(analysis: dict) -> str:
    """The league table and its verdicts, as docs/league.md quotes them."""
    alpha = analysis["alpha"]
    header = ["method", "models", "HPS", "APS", "RAPS", "coverage", "accuracy", "HPS vs CE", "APS vs CE", "detectable (HPS / APS)",
              "verdict"]
    lines = [f"The league on {analysis['dataset']} at alpha = {alpha:g}: mean ± SD of the test set size over seeds and re-splits; "
             f"each method's change against searched CE fine-tuned, per seed, mean [{T_LEVEL:.0%} t interval]; methods by HPS set "
             "size.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cells(row: dict, ranked: bool) -> list[str]:
        size = [f"{row['size'][s][0]:.3f} ± {row['size'][s][1]:.3f}" if s in row["size"] else "—" for s in SCORES]
        changes = row.get("changes", {})
        compared = [change_text(changes[s]) if s in changes else "—" for s in _DECIDING]
        detectable = " / ".join(f"{changes[s]['detectable']:.1f}%" for s in _DECIDING) if changes else "—"
        name = method_name(row["method"]) if ranked else "CE base model (not fine-tuned; not ranked)"
        return [name, str(row["models"]), *size, f"{row['coverage']:.4f}", f"{row['accuracy']:.4f}", *compared, detectable,
                row.get("verdict", "the reference" if row["method"] == _REFERENCE else "—")]

    for row in analysis["ranked"]:
        lines.append("| " + " | ".join(cells(row, True)) + " |")
    if analysis["base"] is not None:
        lines.append("| " + " | ".join(cells(analysis["base"], False)) + " |")
    if analysis["failed"]:
        lines += ["", "Trials that ended without a model (a diverged loss, a crash): "
                  + ", ".join(f"{method_name(m)} {n}" for m, n in sorted(analysis["failed"].items())) + "."]
    lines += ["", f"**The answer on {analysis['dataset']}:** {analysis['answer']}."]
    if analysis.get("searches"):
        from dpsm_ray.results.provenance import value_text

        header = ["method", "search trials", "feasible", "infeasible", "stopped early", "failed", "pick", "its values"]
        lines += ["", "The searches (every trial in league-search.csv): each method's trials by outcome, and the trial whose "
                  "values its 10 seeds re-trained, with its validation set size and coverage.", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in analysis["searches"]:
            pick = row["pick"]
            chosen = "—" if pick is None else (f"trial {pick['trial']} (size {pick['val_set_size']:.3f}, "
                                               f"coverage {pick['val_coverage']:.4f})")
            values = "—" if pick is None else ", ".join(f"{k} {value_text(v)}" for k, v in pick["values"].items())
            lines.append("| " + " | ".join([method_name(row["method"]), str(row["trials"]), str(row["feasible"]), str(row["infeasible"]),
                                             str(row["stopped"]), str(row["failed"]), chosen, values]) + " |")
    return "\n".join(lines) + "\n"
