"""What produced a results directory, as report tables: each method's chosen configuration (the
final stage's rows of trials.parquet), the sweep's settings (sweep.json) and the package versions
(sweep.json's, and the ones installed when the report is written)."""

from __future__ import annotations

import json
import math

import pandas as pd

from dpsm_ray.facts import SAMPLER_TITLES
from dpsm_ray.config import SETTING_LABELS
from dpsm_ray.cards import DEFAULT_RANGES, method_card, method_names, paper_grid, reads
from dpsm_ray.storage.layout import package_versions
from dpsm_ray.results.tables import method_name, method_order, ordered

# The configuration fields the chosen-configuration table shows, with the paper's symbols; a
# method that does not read a field (its card's fields, dpsm_ray/cards/methods.py) shows "—" there.
PARAMETERS = SETTING_LABELS  # the fields marked with a ``label`` (dpsm_ray/config.py), in their order
_UNUSED = "—"
# a search's record (``search.csv`` in a compact copy): one row per search trial, then the knobs it searched and its error
COMPACT_SEARCH = ("method", "trial", "status", "feasible", "val_set_size", "val_coverage", "epochs_completed")


def value_text(value) -> str:
    if value is None:
        return "default"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


def searched_fields(sweep: dict | None, method: str) -> list[str]:
    """The TrainConfig fields the sweep searched for ``method`` (its grid axes with more than one
    value, or its Optuna knobs)."""

    if sweep is None or method not in method_names():
        return []
    if sweep.get("grid"):
        axes = paper_grid(method, dict(map(tuple, sweep.get("grid_fixed", []))), {k: tuple(v) for k, v in sweep.get("grid_subsets", [])})
        return [axis for axis, values in axes.items() if len(values) > 1]
    return list(method_card(method).knobs)


def _search_records(trials, sweep: dict | None):
    """One row per search trial, by method and trial (counted from 1, as the console counts them):
    its status, feasibility, validation set size and coverage, the epochs it ran, the values of the
    knobs its method searched (``provenance.searched_fields``) and its error, if any."""
    search = trials[trials.stage == "search"] if "stage" in trials else trials.iloc[:0]
    rows = []
    for trial in search.sort_values(["method", "trial_index"]).itertuples():
        ran = json.loads(trial.config_json)
        row = {"method": trial.method, "trial": int(trial.trial_index) + 1, **{c: getattr(trial, c) for c in COMPACT_SEARCH[2:]}}
        rows.append({**row, **{knob: ran.get(knob) for knob in searched_fields(sweep, trial.method)}, "error": trial.error})
    knobs = sorted({k for row in rows for k in row} - {*COMPACT_SEARCH, "error"})
    return pd.DataFrame(rows, columns=[*COMPACT_SEARCH, *knobs, "error"])


def write_search_record(reader, path) -> None:
    """``_search_records`` of the sweep ``reader`` (a ``Results``) reads, written to ``path`` as CSV (whole or not at all)."""
    from dpsm_ray.files import write_text

    write_text(path, _search_records(reader.trials, reader.sweep).to_csv(index=False, float_format="%.17g"))


def chosen_configurations(trials: pd.DataFrame, sweep: dict | None) -> tuple[list[list[str]], list[str]] | None:
    """Rows: PARAMETERS; columns: the methods of the final stage, each the configuration its final
    models trained with (one per method: only the seed differs between them); the search's pick
    in **bold**.  Also the notes under the table (the pick's trial, the base model's recipe).
    None without final-stage rows."""
    if trials.empty or "stage" not in trials or not (trials.stage == "final").any():
        return None
    final = trials[trials.stage == "final"]
    configs = {
        m: json.loads(final[final.method == m].sort_values("seed").iloc[0].config_json) for m in ordered(final.method, method_order())
    }
    trained = [m for m in configs if m != "base"]
    rows = [["parameter", *(method_name(m) for m in trained)]]
    for field, label in PARAMETERS.items():
        cells = []
        for method in trained:
            value = configs[method].get(field)
            if not reads(method, field):
                cells.append(_UNUSED)
            elif field == "quantile_lr" and value is None:
                cells.append("default (2 / steps per epoch)")
            else:
                cells.append(f"**{value_text(value)}**" if field in searched_fields(sweep, method) else value_text(value))
        if any(c != _UNUSED for c in cells):
            rows.append([label, *cells])
    notes = []
    picks = search_picks(trials, sweep)
    for method in trained:
        pick = picks.get(method)
        if pick is not None:
            # counted from 1, as the console counts it (trials.parquet's trial_index counts from 0)
            notes.append(f"{method_name(method)}: search trial {int(pick.trial_index) + 1} (validation set size {pick.val_set_size:.3f}, "
                         f"coverage {pick.val_coverage:.3f})")
    if "base" in configs:
        base = configs["base"]
        recipe = ", ".join(
            f"{k.removeprefix('base_')} {value_text(base[k])}"
            for k in ("base_epochs", "base_lr", "base_batch_size", "base_milestones")
            if base.get(k) is not None
        )
        model = final[final.method == "base"].model.iloc[0] if "model" in final else base.get("model")
        notes.append(f"the CE base model ({len(final[final.method == 'base'])} seeds): the {model} recipe"
                     + (f" with {recipe}" if recipe else "") + ", not fine-tuned")
    return rows, notes


def search_outcomes(trials: pd.DataFrame, sweep: dict | None) -> list[list[str]] | None:
    """One row per searched method: its knobs, the trials it was given and ran, how many were
    feasible, infeasible (validation coverage under the floor), stopped early or failed, the
    pick (counted from 1, as the console counts trials) and the learning rates its trials tried
    (ascending): whether every method saw the same candidates.  None without search rows."""
    if trials.empty or "stage" not in trials or not (trials.stage == "search").any():
        return None
    search = trials[trials.stage == "search"]
    picks = search_picks(trials, sweep)
    rows = [["method", "knobs", "trials", "feasible", "infeasible", "stopped early", "failed", "pick", "lr tried"]]
    for method in ordered(search.method, method_order()):
        mine = search[search.method == method]
        picked = picks.get(method)
        pick = "—" if picked is None else f"trial {int(picked.trial_index) + 1} (validation set size {picked.val_set_size:.3f})"
        knobs = searched_fields(sweep, method)
        counts = outcome_counts(mine)
        rows.append([
            method_name(method), f"{len(knobs)} ({', '.join(knobs)})" if knobs else "0", str(len(mine)),
            *(str(counts[outcome]) for outcome in _OUTCOMES), pick,
            ", ".join(f"{lr:.3g}" for lr in sorted(mine.lr.dropna())) if "lr" in mine else "—",
        ])
    return rows


_OUTCOMES = ("feasible", "infeasible", "stopped", "failed")  # how a search trial ends


def outcome_counts(search: pd.DataFrame) -> dict[str, int]:
    """How many of ``search``'s trials (rows with ``status`` and ``feasible``: trials.parquet's, or a
    search record's) ended feasible or infeasible, were stopped early, or failed."""
    ended = search[search.status == "ok"]
    return {"feasible": int((ended.feasible == True).sum()), "infeasible": int((ended.feasible == False).sum()),  # noqa: E712 (nullable)
            "stopped": int((search.status == "stopped").sum()), "failed": int((search.status == "failed").sum())}


def search_picks(trials: pd.DataFrame, sweep: dict | None) -> dict:
    """Each searched method's pick: the search trial (a row of ``trials``) whose searched values its
    final models carry; a method with no final model, or none matching, has none."""
    if trials.empty or "stage" not in trials:
        return {}
    search, final = trials[trials.stage == "search"], trials[trials.stage == "final"]
    picks = {}
    for method in ordered(search.method, method_order()):
        ran = final[final.method == method]
        if not ran.empty:
            config = json.loads(ran.sort_values("seed").iloc[0].config_json)
            pick = _picked_trial(search[search.method == method], config, searched_fields(sweep, method))
            if pick is not None:
                picks[method] = pick
    return picks


def _picked_trial(search: pd.DataFrame, config: dict, fields: list[str]):
    """The search trial whose searched values the final configuration carries (the pick)."""
    for trial in search.sort_values("trial_index").itertuples():
        ran = json.loads(trial.config_json)
        if fields and all(same(ran.get(f), config.get(f)) for f in fields):
            return trial
    return None


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return a == b


def sweep_settings(sweep: dict, evals: pd.DataFrame) -> list[list[str]]:
    """The settings of sweep.json that decide the results, one row each."""

    base = sweep["base"]
    models = sorted(set(evals.model)) if "model" in evals else []
    model = base.get("model", "auto")
    alpha, slack = base["alpha"], sweep.get("coverage_slack", 0.0)
    seeds = sweep.get("final_seeds", 1)
    rows = [["setting", "value"],
            ["sweep", str(sweep.get("name"))],
            ["dataset", str(base["dataset"])],
            ["model", f"{model} ({', '.join(models)})" if model == "auto" and models else str(model)],
            ["methods", ", ".join(method_name(m) for m in sweep.get("methods", []))],
            ["alpha", f"{alpha:g}"],
            ["feasible (the constraint)", f"validation coverage ≥ 1 − α − slack = {1 - alpha - slack:g} (slack {slack:g})"]]
    if sweep.get("grid"):
        budget = sweep.get("grid_budget")
        rows.append([
            "search",
            "the paper's grid" + (f", a seeded random {budget} configurations per method" if budget else ", every configuration"),
        ])
    else:
        sampler = SAMPLER_TITLES.get(str(sweep.get("sampler", "tpe")), str(sweep.get("sampler")))
        per_knob, floor = sweep.get("trials_per_knob"), sweep.get("min_trials")
        methods = [m for m in sweep.get("methods", []) if m in method_names()]
        at_least = f", at least {floor} each" if floor else ""
        each = ", ".join(f"{method_name(m)} {max(per_knob * len(method_card(m).knobs) if per_knob else sweep.get('trials'), floor or 0)}"
                         for m in methods)
        if per_knob is None and not floor:
            rows.append(["search", f"{sampler}, {sweep.get('trials')} trials per method"])
        elif per_knob is None:
            rows.append(["search", f"{sampler}, {sweep.get('trials')} trials per method{at_least} ({each})"])
        else:
            rows.append(["search", f"{sampler}, {per_knob} trials per knob of each method{at_least} ({each})"])
    scheduler = sweep.get("scheduler", "fifo")
    rows.append([
        "scheduler",
        scheduler
        + (
            f" (grace period {sweep.get('grace_period')} epochs, reduction factor {sweep.get('reduction_factor')})"
            if scheduler == "asha"
            else " (every search trial runs to its last epoch)"
        ),
    ])
    ranges = {**DEFAULT_RANGES}
    for knob, bounds in sweep.get("ranges", []):
        ranges[knob] = type(DEFAULT_RANGES[knob])(**bounds) if isinstance(bounds, dict) else type(DEFAULT_RANGES[knob])(*bounds)
    for method in sweep.get("methods", []):
        if sweep.get("grid"):
            axes = paper_grid(
                method, dict(map(tuple, sweep.get("grid_fixed", []))), {k: tuple(v) for k, v in sweep.get("grid_subsets", [])}
            )
            space = "; ".join(f"{axis} {{{', '.join(value_text(v) for v in values)}}}" for axis, values in axes.items())
        else:
            space = "; ".join(
                f"{knob} ∈ [{ranges[knob].low:g}, {ranges[knob].high:g}]{' log' if ranges[knob].log else ''}"
                for knob in (method_card(method).knobs if method in method_names() else ())
            )
        rows.append([f"search space: {method_name(method)}", space])
    first_seed = sweep.get("seed", 0)
    rows += [
        ["final seeds", f"{seeds} (seeds {first_seed}–{first_seed + seeds - 1}), each re-training every method's chosen configuration"],
        ["sweep seed", f"{first_seed} (data split, base model, sampler)"],
        [
            "training",
            f"init {base.get('init')}, {base.get('epochs')} epochs, batch {base.get('batch_size')}"
            + (f", base model {base.get('base_epochs')} epochs" if base.get("init") == "base" and base.get("base_epochs") else ""),
        ],
        [
            "evaluation",
            (
                f"{base.get('eval_splits')} calibration/test re-splits, scores {', '.join(s.upper() for s in base.get('eval_scores', []))};"
                f" validation: {base.get('val_splits')} re-splits"
            ),
        ],
    ]
    if sweep.get("preset"):
        rows.append(["preset", str(sweep["preset"])])
    return rows


def versions_table(sweep: dict | None) -> list[list[str]]:
    """The versions that ran the sweep (sweep.json, else "not recorded") beside the ones
    installed now, which drew the report."""

    recorded = (sweep or {}).get("versions") or {}
    installed = package_versions()
    rows = [["package", "ran the sweep (sweep.json)", "installed when this report was written"]]
    for name in dict.fromkeys([*installed, *recorded]):
        rows.append([name, recorded.get(name, "not recorded"), installed.get(name, "not installed")])
    return rows
