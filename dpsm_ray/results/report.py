"""``dpsm-ray report DIR``: the paper-style tables and figures of a results directory.

Works on a sweep's directory (final-stage rows) and on a single run's ``--out`` directory.  Writes
``report.md`` and ``report.tex`` (the same tables, booktabs) and ``figures/*.png`` and ``*.pdf``
(docs/results.md, "The report").  Table cells are mean ± std over every final model and
calibration/test re-split; DPSM's change against the best baseline is a per-seed paired change
with a 95% t interval over the seeds (``dpsm_ray.results.stats``).  Every caption is computed from
the rows it describes.  The tables and figures are of marginal calibration (one threshold per score,
the paper's); where the rows hold class-conditional calibration too, a table and a figure set the
two side by side.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dpsm_ray import cards
from dpsm_ray.cards import score_card, score_names
from dpsm_ray.conformal import CALIBRATION_TITLES, CALIBRATIONS
from dpsm_ray.files import write_text
from dpsm_ray.cards import reads
from dpsm_ray.results.figures import Context, Figure, draw_figures, save, search_figures
from dpsm_ray.storage.layout import MANIFEST, Results, read_index
from dpsm_ray.results.league import league_section
from dpsm_ray.results.provenance import chosen_configurations, search_outcomes, sweep_settings, versions_table
from dpsm_ray.results.stats import T_LEVEL, paired_change
from dpsm_ray.results.tables import (
    calibration_rows,
    cell,
    chance_warning,
    latex_table,
    latex_text,
    markdown,
    method_name,
    method_order,
    ordered,
    render_columns,
)

# the metrics two scores must agree on, on every evaluation, to be called identical
_AGREEING = ("coverage", "set_size", "covgap", "sscv", "wsc")
_NOT_SIGNIFICANT = "not significant"


# --- DPSM against the baselines ------------------------------------------------------------


def comparisons(evals: pd.DataFrame, metric: str = "set_size") -> list[dict]:
    """DPSM's per-seed paired change of ``metric`` against, per score, the best baseline trained
    by the same protocol (the lowest mean; the base model excluded) and, where it was evaluated,
    the CE base model (the paper's comparison)."""
    methods = ordered(evals["method"], method_order())
    headline = cards.headline_method()
    if headline not in methods:
        return []
    baselines = [m for m in methods if m not in (headline, cards.BASE_MODEL)]
    found = []
    for score in ordered(evals["score"], score_names()):
        means = evals[evals.score == score].groupby("method")[metric].mean()
        if not math.isfinite(means.get(headline, math.nan)):
            continue
        for label, pool in (("best baseline", baselines), ("the CE base model", [cards.BASE_MODEL] if cards.BASE_MODEL in methods else [])):
            present = means.reindex(pool).dropna()
            if present.empty:
                continue
            against = present.idxmin()
            change = paired_change(evals, headline, against, score, metric, by="method")
            if change["seeds"]:
                found.append({**change, "label": label})
    return found


def _interval_cell(change: dict, short: bool = True) -> str:
    """``-3.21% [-8.10, 1.68] n.s.``: the mean change and its interval (n.s.: the interval holds 0)."""
    if change["seeds"] < 2:
        return f"{change['mean']:+.2f}% (1 seed: no interval)"
    mark = "" if change["significant"] else (" n.s." if short else f" ({_NOT_SIGNIFICANT})")
    return f"{change['mean']:+.2f}% [{change['low']:+.2f}, {change['high']:+.2f}]{mark}".replace("-", "−")


def paper_table(evals: pd.DataFrame, metric: str = "set_size", digits: int = 2) -> list[list[str]]:
    """Rows: methods; columns: scores; then DPSM's per-seed paired change against the best baseline
    and against the CE base model (``comparisons``), mean [95% t interval]."""
    methods = ordered(evals["method"], method_order())
    scores = ordered(evals["score"], score_names())
    rows = [["method", *(s.upper() for s in scores)]]
    for method in methods:
        rows.append([method_name(method)] + [cell(evals[(evals.method == method) & (evals.score == s)][metric], digits) for s in scores])
    found = comparisons(evals, metric)
    for label in ("best baseline", "the CE base model"):
        part = {c["score"]: c for c in found if c["label"] == label}
        if part:
            rows.append([f"DPSM vs {label}", *(_interval_cell(part[s]) if s in part else "n/a" for s in scores)])
    return rows


def _comparison_table(found: list[dict]) -> list[list[str]]:
    rows = [["DPSM against", "score", "per-seed change (%)", "mean", f"{T_LEVEL:.0%} t interval", "n (seeds)", "significant?"]]
    for change in sorted(found, key=lambda c: c["label"] != "best baseline"):  # stable: scores stay in order
        interval = "none (1 seed)" if change["seeds"] < 2 else f"[{change['low']:+.2f}, {change['high']:+.2f}]"
        against = "the CE base model" if change["against"] == "base" else f"{method_name(change['against'])} (best baseline)"
        rows.append([against, change["score"].upper(),
                     ", ".join(f"{v:+.2f}" for v in change["per_seed"]), f"{change['mean']:+.2f}%", interval, str(change["seeds"]),
                     "yes" if change["significant"] else _NOT_SIGNIFICANT])
    return rows[:1] + [[c.replace("-", "−") for c in row] for row in rows[1:]]


def _comparison_caption(found: list[dict]) -> str:
    seeds = sorted({c["seeds"] for c in found})
    return (
        "DPSM's percent change of the mean set size against a method, per seed (both from that seed's base model, on the same "
        f"calibration/test re-splits), then the mean and a Student t {T_LEVEL:.0%} interval over n = {'/'.join(map(str, seeds))} seeds; "
        f"{_NOT_SIGNIFICANT} (n.s. in the table above) where the interval holds 0. The best baseline is the one with the lowest mean "
        "set size for that score, the CE base model excluded; negative: DPSM's sets are smaller."
    )


# evals.parquet's columns added later, shown where a sweep wrote them (older results keep their tables)
_LATER_DETAILS = {"empty_rate": ("empty sets", 3), "singleton_rate": ("singletons", 3), "classes_under": ("classes below 1 − α", 1),
                 "ece": ("ECE", 3)}


def details_table(evals: pd.DataFrame) -> list[list[str]]:
    later = [name for name in _LATER_DETAILS if name in evals and evals[name].notna().any()]
    rows = [["method", "score", "coverage", "set size", "CovGap %", "SSCV", "WSC", "accuracy", *(_LATER_DETAILS[n][0] for n in later),
             "models"]]
    for method in ordered(evals["method"], method_order()):
        for score in ordered(evals["score"], score_names()):
            part = evals[(evals.method == method) & (evals.score == score)]
            rows.append([
                method_name(method), score.upper(), cell(part.coverage, 3), cell(part.set_size, 2), cell(part.covgap, 2),
                cell(part.sscv, 3), cell(part.wsc, 3), cell(part.accuracy, 3), *(cell(part[n], _LATER_DETAILS[n][1]) for n in later),
                str(part.run_id.nunique()),
            ])
    return rows


# --- marginal and class-conditional calibration -------------------------------------------------


def _calibration_table(evals: pd.DataFrame, classes: pd.DataFrame, alpha: float) -> list[list[str]]:
    """Per method and score, each calibration in the rows: coverage, set size and CovGap (mean ± std
    over models and re-splits, evals.parquet) and, from classes.parquet, the lowest class coverage
    and how many classes fall short of 1 - alpha (each class's coverage averaged over every model
    and re-split)."""
    rows = [["method", "score", "calibration", "coverage", "set size", "CovGap %", "lowest class coverage", "classes below 1 − α"]]
    for method in ordered(evals["method"], method_order()):
        for score in ordered(evals["score"], score_names()):
            for calibration in CALIBRATIONS:
                part = calibration_rows(evals, calibration)
                part = part[(part.method == method) & (part.score == score)]
                if part.empty:
                    continue
                per_class = calibration_rows(classes, calibration)
                per_class = per_class[(per_class.method == method) & (per_class.score == score)].groupby("label").coverage.mean().dropna()
                lowest = "n/a" if per_class.empty else f"{per_class.min():.3f}"
                short = "n/a" if per_class.empty else f"{int((per_class < 1 - alpha).sum())} of {len(per_class)}"
                rows.append([method_name(method), score.upper(), CALIBRATION_TITLES[calibration],
                             cell(part.coverage, 3), cell(part.set_size, 2), cell(part.covgap, 2), lowest, short])
    return rows


def _calibration_caption(alpha: float) -> str:
    return (
        "Marginal calibration (one threshold per score) against class-conditional calibration (a threshold per class, from that "
        f"class's calibration points alone): coverage, set size and CovGap as in the tables above; lowest class coverage and the "
        f"classes below 1 − α = {1 - alpha:g}: each class's test coverage averaged over every final model and re-split "
        "(classes.parquet). Class-conditional sets promise 1 − α in every class, marginal ones only on average; a class with too "
        "few calibration points for α is in every class-conditional set. Clustered sets (where run) share a threshold among classes "
        "whose scores look alike; RC3P sets also limit the rank of a class among the probabilities (docs/predictor.md)."
    )


# --- scores that give the same sets --------------------------------------------------------


def identical_scores(evals: pd.DataFrame, classes: pd.DataFrame) -> list[tuple[str, str]]:
    """Pairs of scores whose evaluations agree on every one of AGREEING, for every model and
    re-split of every method (and, where classes.parquet is there, on every class's coverage and
    set size): as far as the result files can tell, the same prediction sets."""
    scores = ordered(evals["score"], score_names())
    pairs = []
    for i, first in enumerate(scores):
        for second in scores[i + 1:]:
            if agree(evals, first, second, ["run_id", "split"], _AGREEING) and (
                classes.empty or agree(classes, first, second, ["run_id", "split", "label"], ("coverage", "set_size"))
            ):
                pairs.append((first, second))
    return pairs


def agree(frame: pd.DataFrame, first: str, second: str, key: list[str], columns) -> bool:
    a = frame[frame.score == first].set_index(key)[list(columns)].sort_index()
    b = frame[frame.score == second].set_index(key)[list(columns)].sort_index()
    if a.empty or not a.index.equals(b.index):
        return False
    return bool(((a == b) | (a.isna() & b.isna())).all().all())


def _class_count(classes: pd.DataFrame) -> int | None:
    """K, from classes.parquet (a row for every class, with or without test points); None
    without it (older files)."""
    return None if classes.empty else int(classes.label.nunique())


def _identical_note(pairs: list[tuple[str, str]], evals: pd.DataFrame, classes: pd.DataFrame) -> str | None:
    """The report's one note on scores that give identical results: which, on how many
    evaluations, and for APS and RAPS why they may; None when no two agree.  With K <= k_reg
    classes RAPS's penalty is 0 for every label, RAPS is APS by construction, and one clause says so."""
    if not pairs:
        return None
    groups: list[list[str]] = []  # scores that agree with each other (agreeing is transitive), in the report's order
    for first, second in pairs:
        group = next((g for g in groups if first in g), None)
        if group is None:
            groups.append([first, second])
        elif second not in group:
            group.append(second)
    raps = score_card("raps").parameters
    classes_seen = _class_count(classes)
    evaluations = len(evals[evals.score == pairs[0][0]][["run_id", "split"]].drop_duplicates())
    notes = []
    for group in groups:
        names = f"{', '.join(s.upper() for s in group[:-1])} and {group[-1].upper()}"
        identical = f"{names} give identical results on all {evaluations} model x re-split evaluations"
        with_raps = {"aps", "raps"} <= set(group)
        if with_raps and classes_seen is not None and classes_seen <= raps["k_reg"]:
            notes.append(("" if group == ["aps", "raps"] else f"{identical}; ") + "RAPS is APS here by construction: its penalty "
                         f"λ·max(0, rank(y) − k_reg) is 0 for every one of the {classes_seen} classes (k_reg = {raps['k_reg']}).")
        elif with_raps:
            notes.append(f"{identical}: RAPS adds λ·max(0, rank(y) − k_reg) (λ = {raps['lambda']:g}, k_reg = {raps['k_reg']}) to APS's "
                         f"score, so it can differ only where a label ranked below the top {raps['k_reg']} enters a calibration score or "
                         f"a set; here the penalty changed no result (lowest test accuracy {evals.accuracy.min():.3f}).")
        else:
            notes.append(f"{identical}.")
    return " ".join(notes)


def _chance_note(evals: pd.DataFrame, classes: pd.DataFrame) -> str | None:
    """The report's warning when final models are at or near chance (``tables.chance_warning``:
    accuracy at most a few points above 1/K, or every set of every score holding every class),
    per method with its least accurate such model's reason; None when none is, or K is unknown."""
    classes_seen = _class_count(classes)
    if classes_seen is None or classes_seen < 2:
        return None
    per_model = evals.groupby(["method", "run_id"]).agg(accuracy=("accuracy", "mean"))
    per_model["set_size"] = evals.groupby(["method", "run_id", "score"]).set_size.mean().groupby(["method", "run_id"]).min()
    per_model["reason"] = [chance_warning(row.accuracy, classes_seen, row.set_size) for row in per_model.itertuples()]
    found = []
    for method in ordered(evals.method, method_order()):
        models = per_model.loc[method]
        flagged = models.dropna(subset=["reason"]).sort_values("accuracy")
        if not flagged.empty:
            found.append(f"{method_name(method)}: {len(flagged)} of {len(models)} final models ({flagged.reason.iloc[0]})")
    if not found:
        return None
    return (f"models at or near chance on these {classes_seen} classes: {'; '.join(found)}. Their sets still cover as promised, by "
            "holding (nearly) every class, so they say little about the label: train longer, or check the data and the model.")


# --- the report ----------------------------------------------------------------------------


def _run_context(results: Path, trials: pd.DataFrame, alpha: float) -> Context:
    """What the figures' captions take from trials.parquet's final rows, or from a single run's
    config.json."""
    if trials.empty or "stage" not in trials:
        try:
            config = json.loads((results / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return Context(alpha)
        method = config.get("method")
        used = {field: [str(config.get(field))] for field in ("q_init", "conformal_weight") if reads(method, field)}
        return Context(alpha, q_init={method: used["q_init"]} if "q_init" in used else None,
                       conformal_weight={method: used["conformal_weight"][0]} if "conformal_weight" in used else None)
    final = trials[trials.stage == "final"]

    def values(column: str) -> dict:
        return {
            m: sorted({str(v) if not isinstance(v, float) else f"{v:.4g}" for v in part[column].dropna()})
            for m, part in final.groupby("method")
            if part[column].notna().any()
        }

    weights = {m: ", ".join(v) for m, v in values("conformal_weight").items()}
    return Context(alpha, q_init=values("q_init"), conformal_weight=weights)


def _console_tables(evals: pd.DataFrame, classes: pd.DataFrame, brief: bool) -> tuple[str, tuple]:
    """The tables printed at the end of a sweep (``brief``: the headline ones) or by ``dpsm-ray
    report``, and their parts for report.md and report.tex: of the marginal rows, and the two
    calibrations side by side where class-conditional rows are there too."""
    alpha = float(evals.alpha.iloc[0])
    others = any(not calibration_rows(evals, calibration).empty for calibration in CALIBRATIONS[1:])
    both = _calibration_table(evals, classes, alpha) if others else None
    heading = calibrations_heading(evals)
    evals, classes = calibration_rows(evals), calibration_rows(classes)
    size, details, found = paper_table(evals), details_table(evals), comparisons(evals)
    note = _identical_note(identical_scores(evals, classes), evals, classes)  # said once, under the first table
    chance = _chance_note(evals, classes)
    missing = (
        "n/a: no value; a WSC is n/a when no held-out test point fell in its worst slab (too few test points)."
        if any("n/a" in row for row in details[1:])
        else ""
    )
    text = "\n".join([
        *([f"warning: {chance}", ""] if chance else []),
        f"Average prediction set size at alpha = {alpha:g} (mean ± std over models and calibration/test re-splits)",
        render_columns(size),
        *([f"note: {note}"] if note else []),
        "",
        *(
            [f"DPSM against the baselines, per seed ({T_LEVEL:.0%} t interval over the seeds)",
             render_columns(_comparison_table(found)), ""]
            if found and not brief
            else []
        ),
        *(["All metrics: in report.md"] if brief else ["All metrics", render_columns(details), *([missing] if missing else [])]),
        *(["", heading, render_columns(both)] if both and not brief else []),
    ])
    return text, (size, details, found, note, chance, missing, both)


def calibrations_heading(evals: pd.DataFrame) -> str:
    """"Marginal and class-conditional calibration", naming those evals.parquet holds."""
    shown = [CALIBRATION_TITLES[c] for c in CALIBRATIONS if not calibration_rows(evals, c).empty]
    heading = f"{', '.join(shown[:-1])} and {shown[-1]} calibration" if len(shown) > 1 else f"{shown[0]} calibration"
    return heading[0].upper() + heading[1:]


def headline(results_dir: str | os.PathLike) -> str:
    """What the end of a sweep printed -- its headline tables, from the Parquet files alone --
    without drawing or writing anything (a finished sweep asked again shows this)."""
    reader = Results(results_dir)
    return _console_tables(reader.final("evals"), reader.final("classes"), brief=True)[0]


def _data_warning(results: Path, sweep: dict | None) -> str | None:
    """Why the results in ``results`` no longer describe the data they name (the data's record in
    ``sweep.json``, or a run's ``settings.json``, against the data there now), else None."""
    from dpsm_ray.cards import data_change
    from dpsm_ray.storage.layout import read_run_settings

    if sweep is not None:
        record, dataset = sweep.get("data"), sweep.get("base", {}).get("dataset")
    elif (payload := read_run_settings(results)) is not None:
        record, dataset = payload.get("data"), payload.get("config", {}).get("dataset")
    else:
        return None
    if not record or not dataset:
        return None
    try:
        change = data_change(record, dataset)
    except (OSError, ValueError) as error:
        change = f"it cannot be read now ({str(error).splitlines()[0][:160]})"
    return f"these results were made from other data than {dataset} holds now -- {change}" if change else None


def write_report(results_dir: str | os.PathLike, log=print, *, brief: bool = False) -> str:
    """Print the tables, write ``report.md``, ``report.tex`` and ``figures/*.png`` / ``*.pdf``;
    returns the text printed.  ``brief`` (the end of a sweep): the headline tables only, the rest
    in report.md, and the predictors in one line."""
    reader = Results(results_dir)
    results = reader.directory
    for name in reader.unrecorded():
        log(f"warning: {results / name} has no checksum in {results / MANIFEST} (written by an earlier version); it is read unchecked")
    evals = reader.final("evals")
    if evals.empty:
        raise FileNotFoundError(f"no evaluation rows in {reader.path('evals')}: is this a finished run or sweep directory?")
    alpha = float(evals.alpha.iloc[0])
    epochs, classes, trials, sweep = reader.final("epochs"), reader.final("classes"), reader.trials, reader.sweep
    changed = _data_warning(results, sweep)
    if changed:
        log(f"warning: {changed}")
    search_written = _drawing_search_figures(results, sweep)  # while this process writes the rest
    text, (size, details, found, note, chance, missing, both) = _console_tables(evals, classes, brief)
    log(text)
    size_caption = (
        f"Average prediction set size at α = {alpha:g}: mean ± std over every final model and calibration/test re-split."
        + (" DPSM vs ...: per-seed paired change, mean [95% t interval]; n.s.: the interval holds 0 (next table)." if found else "")
    )
    details_note = f"Mean ± std over models and re-splits; models: final models behind each row. {missing}".rstrip()

    md = [f"# Results: {results.name}", "", *([f"**Warning:** {changed}", ""] if changed else []),
          *([f"**Warning:** {chance}", ""] if chance else []), markdown(size), "", size_caption, ""]
    md += [f"Note: {note}", ""] if note else []
    tex = [*([rf"\textbf{{Warning:}} {latex_text(chance)}"] if chance else []),
           latex_table(size, size_caption, "set-size", note=f"Note: {note}" if note else None)]
    if found:
        _table(md, tex, "## DPSM against the baselines", _comparison_table(found), _comparison_caption(found), "paired", align="llrrrrl")
    md += league_section(calibration_rows(evals), trials, alpha, sweep)
    _table(md, tex, "## All metrics", details, details_note, "metrics", tex_caption=f"All metrics. {details_note}")
    if both:
        _table(md, tex, f"## {calibrations_heading(evals)}", both, _calibration_caption(alpha), "calibrations", align="lllrrrrr")

    more_md, more_tex = _provenance_sections(trials, sweep, evals)
    md += more_md
    tex += more_tex
    md += _predictors_section(results, log, brief)

    figures = _write_figures(results, evals, epochs, classes, _run_context(results, trials, alpha))
    search_written, search_note = search_written()
    for figure in figures:
        md += _markdown_figure(figure, "##")
    md += ["## Search", "", search_note, ""]
    for figure in search_written:
        md += _markdown_figure(figure, "###")
    tex += [_latex_figure(f) for f in [*figures, *search_written]]
    write_text(results / "report.md", "\n".join(md))
    write_text(results / "report.tex", _latex_document(results.name, tex, search_note))
    log(
        f"report written to {results / 'report.md'} and {results / 'report.tex'} with {len(figures) + len(search_written)} figures (PNG and"
        f" PDF) in {results / 'figures'}"
    )
    return text


def _provenance_sections(trials: pd.DataFrame, sweep: dict | None, evals: pd.DataFrame) -> tuple[list[str], list[str]]:
    """The report's sections on where its numbers came from -- the chosen configurations, the
    searches, the sweep's settings, the versions -- as markdown lines and LaTeX tables."""
    md, tex = [], []
    configurations = chosen_configurations(trials, sweep)
    md += ["## Chosen configurations", ""]
    if configurations is None:
        md += [
            (
                "Not recorded: these files have no final-stage rows in trials.parquet (a single run's directory records its configuration"
                " in config.json)."
            ),
            "",
        ]
    else:
        rows, notes = configurations
        caption = ("Each method's configuration, the one its final models re-trained with every seed; bold: chosen by the search "
                   "(the pick, docs/results.md), the rest fixed for the sweep; —: a setting the method does not read. "
                   + "; ".join(notes) + ".")
        _table(md, tex, None, rows, caption, "configurations", align="l" * len(rows[0]))
    outcomes = search_outcomes(trials, sweep)
    if outcomes is not None:
        caption = ("Each method's search: the knobs it searched, its trials, how many reached the coverage floor on validation data "
                   "(feasible) or did not (infeasible), were stopped early or failed, the pick its final models re-trained, and the "
                   "learning rates its trials tried.")
        _table(md, tex, "## Searches", outcomes, caption, "searches", align="lp{0.18\\linewidth}rrrrrp{0.16\\linewidth}p{0.16\\linewidth}")
    md += ["## Sweep settings", ""]
    if sweep is None:
        md += ["Not recorded: no sweep.json in this directory.", ""]
    else:
        _table(md, tex, None, sweep_settings(sweep, evals), "From sweep.json.", "settings", align="lp{0.7\\linewidth}",
               tex_caption="The sweep's settings (sweep.json).")
    _table(md, tex, "## Versions", versions_table(sweep),
           "The versions sweep.json recorded when the sweep started (\"not recorded\": an older sweep, or a single run), and the ones "
           "installed when this report was written, which drew the tables and figures.", "versions", align="lll",
           tex_caption="Package versions: those that ran the sweep, and those installed when this report was written.")
    return md, tex


def _table(md: list[str], tex: list[str], heading: str | None, rows: list[list[str]], caption: str, label: str, *,
           align: str | None = None, tex_caption: str | None = None) -> None:
    """A table into both reports: in report.md under ``heading`` (None: none) with ``caption``, in
    report.tex as a float labelled ``label`` with ``tex_caption`` (default: the same)."""
    md += [*([heading, ""] if heading else []), markdown(rows), "", caption, ""]
    tex.append(latex_table(rows, caption if tex_caption is None else tex_caption, label, align=align))


def _write_figures(results: Path, evals: pd.DataFrame, epochs: pd.DataFrame, classes: pd.DataFrame, context: Context) -> list[Figure]:
    return _write_drawn(results, draw_figures(evals, epochs, classes, context))


def _write_search_figures(results: Path, sweep: dict | None) -> tuple[list[Figure], str]:
    """The search figures, drawn and written, and the sentence saying what was drawn or why not."""
    drawn, note = search_figures(results, sweep)
    return (_write_drawn(results, drawn) if drawn is not None else []), note


def _drawing_search_figures(results: Path, sweep: dict | None) -> Callable[[], tuple[list[Figure], str]]:
    """Start ``_write_search_figures`` in a second Python process, which draws them while this one
    draws the others (a digits sweep's report: 11.9 s -> 8.6 s on 2 cores); returns the
    wait for them.  Drawn here instead, when waited for: on one core, with methods registered
    outside the package (a fresh process would not know their names), or when that process failed
    (so that its error is raised here, as it is).  A subprocess rather than multiprocessing's
    spawn, which would run again the top of a caller's script that has no ``__main__`` guard."""
    import subprocess
    import sys

    drawn, note = search_figures(results, sweep)  # drawing nothing yet: the figures come as they are iterated
    if drawn is None:
        return lambda: ([], note)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2 or cards.outside_cards():  # a child process would not know them
        return lambda: _write_search_figures(results, sweep)
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this very dpsm_ray
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    code = "import sys; from dpsm_ray.results.report import _print_search_figures; _print_search_figures(sys.argv[1])"
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(results)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )

    def wait() -> tuple[list[Figure], str]:
        out, _ = child.communicate()
        if child.returncode != 0:
            return _write_search_figures(results, sweep)
        return [Figure(**figure) for figure in json.loads(out)], note

    return wait


def _print_search_figures(results: str) -> None:
    """``_write_search_figures`` for ``_drawing_search_figures``'s second process: the figures
    written, as JSON on stdout."""
    import dataclasses

    figures, _ = _write_search_figures(Path(results), Results(results).sweep)
    print(json.dumps([dataclasses.asdict(figure) for figure in figures]))


def _write_drawn(results: Path, drawn) -> list[Figure]:
    out = results / "figures"
    out.mkdir(exist_ok=True)
    written = []
    for figure, fig in drawn:
        save(fig, out, figure.name)
        written.append(figure)
    return written


def _markdown_figure(figure: Figure, heading: str) -> list[str]:
    """A figure's lines in report.md: its title under ``heading``, its caption, the PNG and the PDF's path."""
    image = f"![{figure.title}](figures/{figure.name}.png)"
    return [f"{heading} {figure.title}", "", figure.caption, "", image, "", f"PDF: `figures/{figure.name}.pdf`", ""]


def _latex_figure(figure: Figure) -> str:
    return "\n".join([
        r"\begin{figure}[htbp]",
        r"\centering",
        rf"\includegraphics{{figures/{figure.name}.pdf}}",  # at its natural size: drawn at the size it prints
        rf"\caption{{{latex_text(figure.title)}. {latex_text(figure.caption)}}}",
        rf"\label{{fig:{figure.name.replace('_', '-')}}}",
        r"\end{figure}",
    ])


def _latex_document(name: str, parts: list[str], search_note: str) -> str:
    """report.tex: every table (booktabs) and figure (its PDF) of report.md, ready for pdflatex."""
    head = [
        r"\documentclass{article}",
        r"\usepackage[margin=2cm]{geometry}",
        r"\usepackage{booktabs}",
        r"\usepackage{graphicx}",
        r"\usepackage[T1]{fontenc}",
        r"\usepackage[utf8]{inputenc}",
        r"\begin{document}",
        rf"\section*{{Results: {latex_text(name)}}}",
        "",
    ]
    return "\n".join([*head, *(p + "\n" for p in parts), latex_text(search_note), "", r"\end{document}", ""])


def _predictors_section(results: Path, log, brief: bool = False) -> list[str]:
    """report.md's lines on the sweep's predictors (``dpsm_ray.predict.export``): the one chosen per
    method, with its validation and test figures; none for a sweep without predictors."""
    index = read_index(results)
    if index is None:
        return []
    rows = [["predictor", "method", "seed", "val set size", "val coverage", "test coverage (HPS)", "test set size (HPS)"]]
    for method in ordered(list(index["chosen"]), method_order()):
        entry = next(e for e in index["predictors"] if e["name"] == index["chosen"][method])
        hps = entry["test"]["scores"]["hps"]
        validation = [
            "n/a" if entry[key] is None else f"{entry[key]:.3f}" for key in ("val_set_size", "val_coverage")
        ]  # none for a base model
        rows.append([f"`{entry['directory']}`", method_name(method), str(entry["seed"]), *validation,
                     f"{hps['coverage']:.3f}", f"{hps['set_size']:.2f}"])
        if not brief:
            log(f"predictor of {method}: {results / entry['directory']} (dpsm-ray export {results} --method {method} --out DIR)")
    if brief and index["chosen"]:
        log(f"predictors chosen per method: {', '.join(index['chosen'][m] for m in ordered(list(index['chosen']), method_order()))} under "
            f"{results / 'predictors'} (dpsm-ray export {results} --method METHOD --out DIR)")
    return [
        "## Predictors",
        "",
        (
            "Every final model is a conformal predictor under `predictors/` (docs/predictor.md), calibrated on the calibration split and "
            f"measured on the test split. Chosen per method: {index['rule']}."
        ),
        "",
        markdown(rows),
        "",
        (
            "`dpsm-ray export DIR --method METHOD --out OUT` copies the chosen one out (`--seed S` another); `dpsm-ray predict OUT --input"
            " X.npy --out sets.parquet` and `dpsm-ray serve OUT` use it."
        ),
        "",
    ]
