"""The report's figures (docs/results.md, "The report"): each one built as a matplotlib figure with
a caption computed from the rows it draws, then written as PNG and PDF into ``figures/``.

Every figure and panel draws a method in one colour and marker (``method_style``: the paper's order
CE, CUT, ConfTr, DPSM; grey for the CE base model).  Every axis names its quantity, panels that
show one quantity for several scores share their y-axis, a panel whose series differ by more than
10x has a log axis (``y_scale``), and every figure has a legend.

Figures are drawn at the size they print: one panel a column wide (COLUMN_WIDTH), several a page
wide (PAGE_WIDTH), text in 7-8 pt (FIGURE_STYLE), so report.tex sets them at their natural size
and a venue's template at 100%.  Their PDFs embed TrueType (Type 42) fonts, not the Type 3 fonts
matplotlib embeds by default, which many venues reject.  The style is matplotlib's only while a
figure is drawn and saved (``figure_style``): the caller's own settings are left as they were.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dpsm_ray.files import atomic_write
from dpsm_ray.cards import BUILT_IN_METHODS, method_card, method_names
from dpsm_ray.cards import score_names
from dpsm_ray.conformal import CALIBRATION_TITLES, CALIBRATIONS
from dpsm_ray.storage.layout import OPTUNA_DB, CoverageFloor
from dpsm_ray.results.tables import calibration_rows, figure_name, method_order, ordered

FORMATS = ("png", "pdf")
_PNG_DPI = 200  # report.md's images: a page-wide figure 1300 pixels across, its 7 pt text 19 pixels high
# widths in inches: a two-column paper's column is 3.3-3.5 in, a one-column page's text 6.5-7 in
# (report.tex's: letter paper less 2 cm margins, 6.9 in)
COLUMN_WIDTH = 3.4
PAGE_WIDTH = 6.5
FIGURE_STYLE = {
    "pdf.fonttype": 42,  # TrueType fonts in the PDF (Type 3 is matplotlib's default)
    "ps.fonttype": 42,
    "font.size": 8,  # beside a paper's 9-10 pt text, at the figure's natural size
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "legend.fontsize": 7,
    "lines.linewidth": 1.2,
    "lines.markersize": 4,
    "axes.linewidth": 0.6,
}
_LABEL_CHARS = 34  # a y-label or panel title longer than this is wrapped onto a second line
# a panel whose series' typical values differ by more than this factor gets a log y-axis
_LOG_RATIO = 10.0
_COVERAGE_LABEL = "test coverage (fraction of test points)"
_SIZE_LABEL = "average prediction set size (classes)"
# epochs.parquet columns the curves average over a method's runs
_EPOCH_CURVES = ("upper_loss", "lower_loss", "q_error", "q_error_train", "upper_gap", "lower_gap", "train_set_size_q", "val_set_size")


@dataclass(frozen=True)
class Style:
    color: str
    marker: str


# the cards'
STYLES = {"base": Style("tab:gray", "x"), **{card.name: Style(card.colour, card.marker) for card in BUILT_IN_METHODS.values()}}

# methods without a fixed style (a new objective): colours and markers no fixed one uses
_FALLBACK_COLORS = ("tab:purple", "tab:pink", "tab:olive", "tab:cyan")
_FALLBACK_MARKERS = ("P", "*", "h", "X")


def method_style(method: str) -> Style:
    """The colour and marker of ``method`` in every figure; an unknown method gets one from a
    hash of its name, the same in every figure and every run (Python's ``hash`` is salted)."""
    if method in STYLES:
        return STYLES[method]
    if method in method_names() and method_card(method).colour and method_card(method).marker:
        return Style(method_card(method).colour, method_card(method).marker)
    digest = int(hashlib.sha256(method.encode()).hexdigest(), 16)
    colours, markers = _FALLBACK_COLORS, _FALLBACK_MARKERS
    return Style(colours[digest % len(colours)], markers[(digest // len(colours)) % len(markers)])


def name_of(method: str) -> str:
    return figure_name(method)


def y_scale(series: list) -> str:
    """"log" when the series' typical values (median of |value|) differ by more than LOG_RATIO
    and every value is positive, "symlog" when they differ as much but some value is <= 0 (a gap
    that reaches 0), else "linear"."""
    values = [np.asarray(s, dtype=float) for s in series]
    values = [v[np.isfinite(v)] for v in values]
    typical = [float(np.median(np.abs(v))) for v in values if v.size]
    typical = [t for t in typical if t > 0]
    if len(typical) < 2 or max(typical) <= _LOG_RATIO * min(typical):
        return "linear"
    return "log" if all((v > 0).all() for v in values if v.size) else "symlog"


def _apply_scale(axes, series: list) -> str:
    scale = y_scale(series)
    if scale == "symlog":
        typical = [float(np.median(np.abs(v[np.isfinite(v)]))) for v in map(np.asarray, series) if np.isfinite(v).any()]
        threshold = min(t for t in typical if t > 0)
        for ax in np.atleast_1d(axes):
            ax.set_yscale("symlog", linthresh=threshold)
    elif scale == "log":
        for ax in np.atleast_1d(axes):
            ax.set_yscale("log")
    return scale


_SCALE_WORDS = {
    "log": "a log scale: its series differ by more than 10x",
    "symlog": "a symmetric log scale: its series differ by more than 10x and reach 0",
}


def _scale_note(scale: str) -> str:
    return f" (on {_SCALE_WORDS[scale]})" if scale in _SCALE_WORDS else ""


@dataclass(frozen=True)
class Figure:
    """A figure in ``figures/`` (``name``.png and .pdf) and its section of the report."""

    name: str
    title: str
    caption: str


@dataclass(frozen=True)
class Context:
    """What the captions say about the run beyond the plotted rows (None: not recorded)."""

    alpha: float
    q_init: dict | None = None  # method -> DPSM's q_0 setting(s) of its final models
    conformal_weight: dict | None = None  # method -> lambda of its final models


@contextmanager
def figure_style():
    """FIGURE_STYLE as matplotlib's settings inside the block, the caller's again after it."""
    import matplotlib

    with matplotlib.rc_context(FIGURE_STYLE):
        yield


def _styled(drawing: Iterator) -> Iterator:
    """``drawing``'s figures, each drawn in ``figure_style``: the generator runs in the style up
    to each figure it hands out and the caller gets the figure with its own settings back (a
    ``with`` inside the generator would hold the style while the caller runs)."""
    while True:
        with figure_style():
            drawn = next(drawing, None)
        if drawn is None:
            return
        yield drawn


def _wrapped(text: str, width: int = _LABEL_CHARS) -> str:
    """``text`` on lines of at most ``width`` characters (an axis label along a short axis)."""
    return "\n".join(textwrap.wrap(text, width)) if len(text) > width else text


def _method_handles(methods: list[str], kind: str = "line") -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if kind == "box":
        return [Patch(facecolor=method_style(m).color, edgecolor="black", alpha=0.7, label=name_of(m)) for m in methods]
    return [Line2D([], [], color=method_style(m).color, marker=method_style(m).marker, label=name_of(m)) for m in methods]


def _target_handle(alpha: float):
    from matplotlib.lines import Line2D

    return Line2D([], [], color="black", linestyle="--", linewidth=1, label=f"1 − α = {1 - alpha:g}")


def _legend_below(fig, handles: list) -> None:
    """The legend under the panels, in as few rows as the figure's width allows: each column
    as wide as the longest entry (its line and a gap, 2.8 em, and its text at ~0.55 em a
    character), 2 em between columns, 1 em of frame."""
    ems = fig.get_figwidth() * 72 / FIGURE_STYLE["legend.fontsize"]
    entry = 2.8 + 0.55 * max(len(h.get_label()) for h in handles)
    fits = max(1, min(len(handles), int((ems - 1.0 + 2.0) // (entry + 2.0))))
    columns = math.ceil(len(handles) / math.ceil(len(handles) / fits))  # rows as full as each other: 3 + 3, not 5 + 1
    fig.legend(handles=handles, loc="outside lower center", ncol=columns)


def boxes(ax, data: list[np.ndarray], methods: list[str]) -> None:
    """Box plots coloured by method (empty boxes for a method without values)."""
    drawn = ax.boxplot([d if len(d) else [math.nan] for d in data], tick_labels=[name_of(m) for m in methods], patch_artist=True,
                       medianprops={"color": "black"})
    for patch, method in zip(drawn["boxes"], methods):
        patch.set_facecolor(method_style(method).color)
        patch.set_alpha(0.7)
    # at 45 degrees, each label's end at its tick: six methods' names fit a third of a page without overlapping
    ax.tick_params(axis="x", labelrotation=45, labelrotation_mode="xtick")


def line(ax, part: pd.DataFrame, column: str, method: str, **options) -> None:
    from matplotlib.ticker import MaxNLocator

    style = method_style(method)
    options = {
        "color": style.color,
        "marker": style.marker,
        "markevery": max(1, len(part) // 10),
        "markersize": 4,
        "label": name_of(method),
        **options,
    }
    ax.plot(part.epoch, part[column], **options)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _counts_text(evals: pd.DataFrame, methods: list[str]) -> str:
    """How many models and re-splits are behind each box of ``evals`` (per score)."""
    per = {m: (evals[evals.method == m].run_id.nunique(), evals[evals.method == m].split.nunique()) for m in methods}
    if len(set(per.values())) == 1:
        models, splits = next(iter(per.values()))
        return (
            f"each box: {models} model{'s' * (models != 1)} x {splits} calibration/test re-split{'s' * (splits != 1)} = {models * splits}"
            " values"
        )
    return "each box: " + "; ".join(f"{name_of(m)} {a} model{'s' * (a != 1)} x {b} re-splits" for m, (a, b) in per.items())


def change_text(part: pd.DataFrame, column: str, towards_zero: bool = False) -> str:
    """``column`` from its first to its last epoch, and whether it grew or fell (``towards_zero``:
    whether its size did, for a gap that may be negative)."""
    values = part.dropna(subset=[column])
    if values.empty:
        return "not recorded"
    first, last = values.iloc[0][column], values.iloc[-1][column]
    span = f"from {first:.3g} (epoch {int(values.iloc[0].epoch)}) to {last:.3g} (epoch {int(values.iloc[-1].epoch)})"
    if towards_zero and (first < 0 or last < 0):
        closer = "closer to 0" if abs(last) < abs(first) else "further from 0" if abs(last) > abs(first) else "no closer to 0"
        return f"went {span}, {closer}"
    return f"{'grew' if last > first else 'fell' if last < first else 'stayed'} {span}"


def _panel_notes(scales: list[str]) -> str:
    """The captions' words on which of a figure's panels have a log axis."""
    named = [f"{side} panel on {_SCALE_WORDS[scale]}" for side, scale in zip(("left", "right"), scales) if scale in _SCALE_WORDS]
    return f" ({'; '.join(named)})" if named else ""


_Q_INIT_WORDS = {"dataset": "Q_n of the starting model's D1 scores", "zero": "0", "random": "Unif(0, 1) from the run seed"}


def _panels_width(panels: int) -> float:
    return COLUMN_WIDTH if panels == 1 else PAGE_WIDTH


def draw_figures(evals: pd.DataFrame, epochs: pd.DataFrame, classes: pd.DataFrame, context: Context) -> Iterator[tuple[Figure, object]]:
    """Every figure the rows have the columns for (older result files lack some), as
    ``(Figure, matplotlib figure)``; the caller saves (``save``) and closes each."""
    return _styled(_drawings(evals, epochs, classes, context))


def _drawings(evals: pd.DataFrame, epochs: pd.DataFrame, classes: pd.DataFrame, context: Context) -> Iterator[tuple[Figure, object]]:
    """``draw_figures``'s figures in the report's order, each drawn when the caller asks for it."""
    import matplotlib

    matplotlib.use("Agg")
    evals = calibration_rows(evals)  # the paper's figures: marginal calibration
    yield _coverage_box_figure(evals, context.alpha)
    yield _apss_box_figure(evals)
    if not epochs.empty:  # load() has kept a sweep's final stage only: the curves of the chosen configurations
        curves = epoch_curves(epochs)
        yield _losses_figure(curves, context)
        if curves.quantile_methods and {"upper_gap", "lower_gap"} <= set(curves.columns):
            yield _loss_gaps_figure(curves)
        if curves.quantile_methods:
            yield q_error_figure(curves, context)
        if curves.quantile_methods and "train_set_size_q" in curves.columns:
            yield _set_size_gap_figure(curves)
    for calibration in CALIBRATIONS:
        if not calibration_rows(classes, calibration).empty:
            yield _class_coverage_figure(calibration_rows(classes, calibration), context.alpha, calibration)


# --- box plots: one panel per score, one box per method -----------------------------------------


def _box_row(axes, data: dict, methods: list[str], scores: list[str], label: str, target: float | None) -> str:
    """A row of panels, one per score, of ``data`` (score -> one array per method), on one y
    scale, a dashed line at ``target`` if given, ``label`` on the first; returns the scale."""
    scale = _apply_scale(axes, [v for s in scores for v in data[s]])
    for ax, score in zip(axes, scores):
        boxes(ax, data[score], methods)
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1)
        ax.set_title(score.upper())
    axes[0].set_ylabel(_wrapped(label + ("" if scale == "linear" else f", {scale} scale")))
    return scale


def _evals_boxes(evals: pd.DataFrame, metric: str, label: str, alpha: float | None = None) -> tuple[object, str]:
    """``evals``' ``metric`` in a row of box panels, a dashed 1 − ``alpha`` (if given) in them and
    in the legend; returns the figure and its y scale."""
    import matplotlib.pyplot as plt

    methods = ordered(evals["method"], method_order())
    scores = ordered(evals["score"], score_names())
    fig, axes = plt.subplots(1, len(scores), figsize=(_panels_width(len(scores)), 2.8), squeeze=False, sharey=True, layout="constrained")
    data = {s: [evals[(evals.method == m) & (evals.score == s)][metric].to_numpy() for m in methods] for s in scores}
    scale = _box_row(axes[0], data, methods, scores, label, None if alpha is None else 1 - alpha)
    _legend_below(fig, _method_handles(methods, "box") + ([_target_handle(alpha)] if alpha is not None else []))
    return fig, scale


def _coverage_box_figure(evals: pd.DataFrame, alpha: float) -> tuple[Figure, object]:
    """Paper figure 1, top: the final models' test coverage per score against 1 − α."""
    fig, _ = _evals_boxes(evals, "coverage", _COVERAGE_LABEL, alpha)
    counts = _counts_text(evals, ordered(evals["method"], method_order()))
    means = evals.groupby(["method", "score"])["coverage"].mean()
    low, high = means.idxmin(), means.idxmax()
    caption = (
        f"Test coverage of each method's final models per score (paper figure 1, top); {counts}. Dashed: 1 − α = {1 - alpha:g}."
        f" Mean coverage ranges from {means[low]:.3f} ({name_of(low[0])}, {low[1].upper()}) to {means[high]:.3f}"
        f" ({name_of(high[0])}, {high[1].upper()})."
    )
    return Figure("coverage_box", "Coverage", caption), fig


def _apss_box_figure(evals: pd.DataFrame) -> tuple[Figure, object]:
    """Paper figure 1, bottom: the final models' average prediction set size per score."""
    fig, scale = _evals_boxes(evals, "set_size", _SIZE_LABEL)
    counts = _counts_text(evals, ordered(evals["method"], method_order()))
    means = evals.groupby(["method", "score"])["set_size"].mean()
    lowest = "; ".join(
        f"{s.upper()} {name_of(means.xs(s, level='score').idxmin())} ({means.xs(s, level='score').min():.3f})"
        for s in ordered(evals["score"], score_names())
    )
    caption = (
        "Test average prediction set size per score (paper figure 1, bottom; lower is better at equal"
        f" coverage){_scale_note(scale)}; {counts}. Lowest mean: {lowest}."
    )
    return Figure("apss_box", "Average prediction set size", caption), fig


def _class_coverage_figure(classes: pd.DataFrame, alpha: float, calibration: str = "marginal") -> tuple[Figure, object]:
    """Paper figures 5-6: each class's coverage (top row) and set size (bottom row) per score, of
    the sets of one ``calibration`` (``class``: a threshold per class)."""
    import matplotlib.pyplot as plt

    # one value per final model and class: its mean over the re-splits
    per_class = classes.groupby(["method", "score", "run_id", "label"])[["coverage", "set_size"]].mean().reset_index()
    methods = ordered(per_class["method"], method_order())
    scores = ordered(per_class["score"], score_names())
    fig, axes = plt.subplots(2, len(scores), figsize=(_panels_width(len(scores)), 4.6), squeeze=False, sharey="row", layout="constrained")
    for row, (metric, label) in enumerate((("coverage", "class-conditional test coverage"), ("set_size", "class-wise " + _SIZE_LABEL))):
        data = {
            s: [per_class[(per_class.method == m) & (per_class.score == s)][metric].dropna().to_numpy() for m in methods]
            for s in scores
        }
        _box_row(axes[row], data, methods, scores, label, 1 - alpha if metric == "coverage" else None)
    _legend_below(fig, _method_handles(methods, "box") + [_target_handle(alpha)])
    shape = per_class.groupby("method").agg(models=("run_id", "nunique"), labels=("label", "nunique"))
    splits = classes.groupby("method").split.nunique()
    behind = "; ".join(f"{name_of(m)} {shape.labels[m]} classes x {shape.models[m]} models" for m in methods)
    worst = per_class.groupby(["method", "score"]).coverage.min()
    lowest = per_class.loc[per_class.coverage.idxmin()] if per_class.coverage.notna().any() else None
    names = classes.dropna(subset=["class_name"]).drop_duplicates("label").set_index("label").class_name if "class_name" in classes else {}
    lowest_class = f", class {names[lowest.label]!r}" if lowest is not None and lowest.label in names else ""
    sets = {"marginal": "", "class": " of class-conditional sets (a threshold per class, calibrated on that class's points alone)",
            "cluster": " of clustered sets (a threshold per cluster of classes whose scores look alike)",
            "rc3p": " of RC3P sets (a threshold and a limit on the label's rank per class)"}[calibration]
    caption = (
        f"Each class's test coverage (top) and average set size (bottom){sets}, per final model, averaged over its"
        f" {'/'.join(str(v) for v in sorted(set(splits)))} re-splits (paper figures 5-6); each box: {behind}. Dashed: 1 − α ="
        f" {1 - alpha:g}. Lowest class coverage: {worst.min():.3f} ({name_of(worst.idxmin()[0])},"
        f" {worst.idxmin()[1].upper()}{lowest_class})."
    )
    if calibration == "class":
        return Figure("class_coverage_classwise", "Class-conditional coverage of class-conditional sets", caption), fig
    if calibration != "marginal":
        title = f"Class-conditional coverage of {CALIBRATION_TITLES[calibration]} sets"
        return Figure(f"class_coverage_{calibration}", title, caption), fig
    return Figure("class_coverage", "Class-conditional coverage", caption), fig


# --- curves over the epochs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Curves:
    """epochs.parquet's curves, each averaged over a method's runs at every epoch."""

    mean: pd.DataFrame  # method, epoch and ``columns``
    columns: list[str]  # the EPOCH_CURVES the rows have (older files lack some)
    methods: list[str]  # in the paper's order
    quantile_methods: list[str]  # the methods whose rows hold a quantile they learn or estimate (ConfTr's batch τ, DPSM's q)
    runs: pd.Series  # method -> how many runs its curves average

    def of(self, method: str) -> pd.DataFrame:
        return self.mean[self.mean.method == method]


def epoch_curves(epochs: pd.DataFrame) -> Curves:
    columns = [c for c in _EPOCH_CURVES if c in epochs.columns]
    mean = epochs.groupby(["method", "epoch"], sort=True)[columns].mean().reset_index()
    methods = ordered(mean["method"], method_order())
    # the methods whose runs wrote the quantile diagnostics (an objective's training_quantiles): no list of names
    estimated = set(epochs.loc[epochs["q_error"].notna(), "method"]) if "q_error" in epochs else set()
    return Curves(mean, columns, methods, [m for m in methods if m in estimated], epochs.groupby("method").run_id.nunique())


def learns_quantile(method: str) -> bool:
    """Whether ``method``'s objective keeps a quantile as state (DPSM's q), rather than estimating
    one from each batch (ConfTr's τ): its card's objective overrides ``learned_quantile``."""
    from dpsm_ray.objectives.base import Objective

    if method not in method_names():
        return False
    return method_card(method).objective_class().learned_quantile is not Objective.learned_quantile


def _losses_figure(curves: Curves, context: Context) -> tuple[Figure, object]:
    """Paper figure 2(a)(b): the upper-level (training) loss and the lower-level pinball loss per epoch."""
    lower_methods = [m for m in curves.methods if curves.of(m).lower_loss.notna().any()]
    fig, (upper, lower) = _epoch_pair(
        ("upper-level loss CE + λ·L_c (training batches)", "lower-level pinball loss at q / τ (training batches)"),
        ("Upper-level loss", "Lower-level loss" + ("" if lower_methods else ": no method with a quantile")))
    for method in curves.methods:
        line(upper, curves.of(method), "upper_loss", method)
    for method in lower_methods:
        line(lower, curves.of(method), "lower_loss", method)
    upper_scale = _apply_scale(upper, [curves.of(m).upper_loss.to_numpy() for m in curves.methods])
    lower_scale = _apply_scale(lower, [curves.of(m).lower_loss.to_numpy() for m in lower_methods])
    _legend_below(fig, _method_handles(curves.methods))
    weights = context.conformal_weight or {}
    weight_text = (
        "; λ of the chosen configurations: " + ", ".join(f"{name_of(m)} {weights[m]}" for m in curves.methods if m in weights)
        if weights
        else ""
    )
    runs_text = ", ".join(f"{name_of(m)} {curves.runs[m]}" for m in curves.methods)
    caption = (
        "Epoch means of the training objective (left) and of the pinball loss at q (DPSM) or the batch τ (ConfTr)"
        f" (right){_panel_notes([upper_scale, lower_scale])} on the training batches, averaged over each method's final models"
        f" ({runs_text}) (paper figure 2(a)(b)){weight_text}."
    )
    return Figure("losses", "Training losses", caption), fig


def _loss_gaps_figure(curves: Curves) -> tuple[Figure, object]:
    """Paper figure 2(c)(d): the upper and lower losses at the learned quantile minus at Q_n."""
    methods = curves.quantile_methods
    fig, (upper, lower) = _epoch_pair(("upper loss at q − at Q_n (training split)", "pinball loss at q − at Q_n (training split)"),
                                      ("Upper-level gap", "Lower-level gap (never negative)"))
    for method in methods:
        line(upper, curves.of(method), "upper_gap", method)
        line(lower, curves.of(method), "lower_gap", method)
    scales = [_apply_scale(ax, [curves.of(m)[c].to_numpy() for m in methods]) for ax, c in ((upper, "upper_gap"), (lower, "lower_gap"))]
    for ax in (upper, lower):
        ax.axhline(0, color="black", linestyle=":", linewidth=1)
    _legend_below(fig, _method_handles(methods))
    measured = "; ".join(
        f"{name_of(m)}'s upper gap {change_text(curves.of(m), 'upper_gap', towards_zero=True)}, "
        f"its lower gap {change_text(curves.of(m), 'lower_gap', towards_zero=True)}"
        for m in methods
    )
    caption = (
        "The upper and lower losses over the training split at the learned quantile minus at its Q_n (paper figure 2(c)(d); "
        f"the paper's DPSM gaps fall towards 0){_panel_notes(scales)}. Measured here: {measured}."
    )
    return Figure("loss_gaps", "Optimisation gaps", caption), fig


def _epoch_pair(ylabels: tuple[str, str], titles: tuple[str, str]):
    """A page-wide figure of two panels against the epoch: their y labels (wrapped) and titles (as given)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(PAGE_WIDTH, 2.6), layout="constrained")
    for ax, ylabel, title in zip(axes, ylabels, titles):
        ax.set_xlabel("epoch")
        ax.set_ylabel(_wrapped(ylabel))
        ax.set_title(title)
    return fig, axes


def q_error_figure(curves: Curves, context: Context) -> tuple[Figure, object]:
    """Paper figure 3(a): |q − Q_n| per epoch, against Q_n of the training split (solid) and of D1 (dashed)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    methods = curves.quantile_methods
    fig, ax = plt.subplots(figsize=(COLUMN_WIDTH, 2.8), layout="constrained")
    series = []
    for method in methods:
        part = curves.of(method)
        if "q_error_train" in curves.columns:
            line(ax, part, "q_error_train", method)
            series.append(part.q_error_train.to_numpy())
        line(ax, part, "q_error", method, linestyle="--", label=None)
        series.append(part.q_error.to_numpy())
    scale = _apply_scale(ax, series)
    ax.set_xlabel("epoch")
    ax.set_ylabel("|q − Q_n| (HPS score units)")
    ax.set_title("Quantile estimation error")
    keys = [Line2D([], [], color="black", label="Q_n of training split")] if "q_error_train" in curves.columns else []
    keys.append(Line2D([], [], color="black", linestyle="--", label="Q_n of D1"))
    _legend_below(fig, _method_handles(methods) + keys)
    column = "q_error_train" if "q_error_train" in curves.columns else "q_error"
    measured = "; ".join(
        f"{name_of(m)} ({'learned q' if learns_quantile(m) else 'batch τ'}) {change_text(curves.of(m), column)}" for m in methods
    )
    start = "".join(
        f" {name_of(m)}'s q_0: {', '.join(f'{v} ({_Q_INIT_WORDS.get(v, v)})' for v in (context.q_init or {})[m])}."
        if (context.q_init or {}).get(m) else f" {name_of(m)}'s q_0: not recorded in these files."
        for m in methods if learns_quantile(m)
    )
    caption = (
        "|q − Q_n| with Q_n over the whole training split (solid, paper figure 3(a)) and over D1, the half q is fitted on"
        f" (dashed){_scale_note(scale)}; ConfTr's is the mean over its batch quantiles τ.{start} Against Q_n of the"
        f" {'training split' if column == 'q_error_train' else 'D1 half'}: {measured}."
    )
    return Figure("q_error", "Quantile estimation error", caption), fig


def _set_size_gap_figure(curves: Curves) -> tuple[Figure, object]:
    """Paper figure 3(c): the training split's set size at q against the validation set size, and their difference."""
    from matplotlib.lines import Line2D

    methods = curves.quantile_methods
    fig, (sizes, gaps) = _epoch_pair(("average set size (classes)", "|training − validation| set size (classes)"),
                                     (_wrapped("Training split at q (solid), validation (dashed)"), "Their difference"))
    for method in methods:
        part = curves.of(method)
        line(sizes, part, "train_set_size_q", method)
        line(sizes, part, "val_set_size", method, linestyle="--", label=None)
        line(gaps, part.assign(gap=(part.train_set_size_q - part.val_set_size).abs()), "gap", method)
    size_scale = _apply_scale(sizes, [curves.of(m)[c].to_numpy() for m in methods for c in ("train_set_size_q", "val_set_size")])
    keys = [
        Line2D([], [], color="black", label="training split at q"),
        Line2D([], [], color="black", linestyle="--", label="validation split"),
    ]
    _legend_below(fig, _method_handles(methods) + keys)
    last = curves.mean.sort_values("epoch").groupby("method").tail(1).set_index("method")
    measured = ", ".join(f"{name_of(m)} {abs(last.train_set_size_q[m] - last.val_set_size[m]):.3f}" for m in methods)
    caption = (
        "The training split's hard set size at the learned quantile against the validation set size (paper figure 3(c), its"
        f" learning-bound proxy; the paper has DPSM's gap below ConfTr's){_scale_note(size_scale)}. Gap at the last epoch:"
        f" {measured}."
    )
    return Figure("set_size_gap", "Training against validation set size", caption), fig


def search_figures(results: Path, sweep: dict | None) -> tuple[Iterator[tuple[Figure, object]] | None, str]:
    """Each method's Optuna search (``optuna.db``): its optimisation history with the infeasible
    trials marked (validation coverage below the sweep's floor, the constraint the sweep tells
    Optuna) and, with at least 3 complete trials and 2 parameters, Optuna's parameter importances.
    Returns the figures (None when there are none) and a sentence saying what was drawn or why not."""
    if sweep is None:
        return None, "No search figures: not a sweep's directory (no sweep.json)."
    if sweep.get("grid"):
        return None, "No search figures: a grid sweep (`--grid paper`) has no Optuna studies."
    if sweep.get("optuna_storage"):
        return (
            None,
            (
                f"No search figures: the Optuna studies live in {sweep['optuna_storage']}, not in this directory (the report reads a local"
                " optuna.db only)."
            ),
        )
    if not (results / OPTUNA_DB).exists():
        return None, "No search figures: there is no optuna.db in this directory."
    return (
        draw_search(results, sweep),
        (
            "One figure per method from its Optuna study in optuna.db (read from a copy): the validation set size of each complete trial,"
            " infeasible ones marked, and the best feasible value so far; and, for a study with at least 3 complete trials and 2"
            " parameters, Optuna's parameter importances (its default evaluator, PED-ANOVA). Stopped (pruned) and failed trials have no"
            " value to draw."
        ),
    )


def draw_search(results: Path, sweep: dict) -> Iterator[tuple[Figure, object]]:
    """``search_figures``'s figures, as ``(Figure, matplotlib figure)``; the caller saves and closes each."""
    return _styled(_search_drawings(results, sweep))


def _search_drawings(results: Path, sweep: dict) -> Iterator[tuple[Figure, object]]:
    """``draw_search``'s figures, method by method in the paper's order: its history, then its importances."""
    import matplotlib

    matplotlib.use("Agg")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    floor = CoverageFloor.of(sweep).value
    with tempfile.TemporaryDirectory() as scratch:  # never open the sweep's own database: a copy
        copy = Path(scratch) / OPTUNA_DB
        shutil.copyfile(results / OPTUNA_DB, copy)
        storage = f"sqlite:///{copy}"
        for method in ordered(list(sweep.get("studies", {})), method_order()):
            try:
                study = optuna.load_study(study_name=sweep["studies"][method], storage=storage)
            except KeyError:  # a study the sweep had not created yet when it was interrupted
                continue
            trials = study.get_trials(deepcopy=False)
            complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
            if not complete:
                continue
            yield _history_figure(study, method, trials, floor)
            params = sorted({p for t in complete for p in t.params})
            if len(complete) >= 3 and len(params) >= 2:
                yield _importance_figure(study, method, complete, params)


def _history_figure(study, method: str, trials: list, floor: float) -> tuple[Figure, object]:
    """Optuna's optimisation history of ``method``'s study (``trials``: all of them), restyled: each
    complete trial's validation set size, the infeasible ones (coverage below ``floor``) crossed."""
    import matplotlib
    import optuna
    from optuna.visualization.matplotlib import plot_optimization_history

    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    infeasible = [t for t in complete if any(v > 0 for v in t.constraints.values())]  # constraint: floor - coverage
    states = pd.Series([t.state.name.lower() for t in trials]).value_counts()
    # Optuna's plots set the ggplot style globally: for them only, the report's style back for the rest
    with matplotlib.rc_context(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ax = plot_optimization_history(study, target_name="validation set size (classes)")
    _restyle_history(ax, method, floor)
    ax.figure.set_size_inches(COLUMN_WIDTH, 2.6)
    ax.figure.set_layout_engine("constrained")
    caption = (
        f"{name_of(method)}'s search ({len(trials)} trials: {', '.join(f'{n} {s}' for s, n in states.items())}): each complete"
        f" trial's validation set size (the objective), {len(infeasible)} of {len(complete)} infeasible (validation coverage below"
        f" {floor:g}, crossed), and the best feasible value so far."
    )
    return Figure(f"search_{method}", f"Search: {name_of(method)}", caption), ax.figure


def _importance_figure(study, method: str, complete: list, params: list[str]) -> tuple[Figure, object]:
    """Optuna's parameter importances for ``method``'s study (``complete``: its complete trials), restyled."""
    import matplotlib
    from optuna.visualization.matplotlib import plot_param_importances

    with matplotlib.rc_context(), warnings.catch_warnings():  # as history_figure's: Optuna's ggplot style for its plot only
        warnings.simplefilter("ignore")
        ax = plot_param_importances(study, target_name="validation set size")
    _restyle_importances(ax, method)
    ax.figure.set_size_inches(COLUMN_WIDTH, 1.0 + 0.3 * len(params))
    ax.figure.set_layout_engine("constrained")
    caption = (
        f"How much each of {name_of(method)}'s searched parameters ({', '.join(params)}) explains the validation set size of"
        f" its {len(complete)} complete trials (Optuna's default importance evaluator, PED-ANOVA; normalised to sum to 1). With"
        f" {len(complete)} trials this is a rough guide."
    )
    return Figure(f"importance_{method}", f"Parameter importance: {name_of(method)}", caption), ax.figure


_OPTUNA_INFEASIBLE = "#cccccc"  # how plot_optimization_history draws infeasible trials (unlabelled)


def _restyle_history(ax, method: str, floor: float) -> None:
    """Optuna's history plot in the method's colour and marker, infeasible trials crossed in black."""
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D

    style = method_style(method)
    handles = [Line2D([], [], marker="o", color=style.color, linestyle="", label=f"{name_of(method)} trial (complete)")]
    for collection in list(ax.collections):
        if to_rgba(collection.get_facecolor()[0] if len(collection.get_facecolor()) else "none") == to_rgba(_OPTUNA_INFEASIBLE):
            collection.set_visible(False)
            points = collection.get_offsets()
            if len(points):
                ax.scatter(points[:, 0], points[:, 1], marker="x", color="black", zorder=3)
                handles.append(Line2D([], [], marker="x", color="black", linestyle="", label=f"infeasible (val coverage < {floor:g})"))
        else:
            collection.set_facecolor(style.color)
            collection.set_edgecolor(style.color)
    for drawn in ax.lines:
        drawn.set_color(style.color)
    if ax.lines:
        handles.append(Line2D([], [], color=style.color, label="best feasible so far"))
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    for legend in list(ax.figure.legends):
        legend.remove()
    for drawn in ax.lines:  # the best value so far holds until a better trial: a step, not a slope
        drawn.set_drawstyle("steps-post")
    _number_from_one(ax)
    _plain_axes(ax)
    ax.set_title(f"{name_of(method)}: Optuna search")
    ax.set_xlabel("trial")
    ax.set_ylabel(_wrapped(ax.get_ylabel()))
    ax.legend(handles=handles)


def _number_from_one(ax) -> None:
    """Optuna draws trial n at x = n, from 0; the console, trials.parquet's pick ("search trial 1")
    and the report count trials from 1: every point and line moves one to the right."""
    for collection in ax.collections:
        points = collection.get_offsets()
        if len(points):
            collection.set_offsets(np.column_stack([points[:, 0] + 1, points[:, 1]]))
    for drawn in ax.lines:
        drawn.set_xdata(np.asarray(drawn.get_xdata(), dtype=float) + 1)
    xs = np.concatenate([c.get_offsets()[:, 0] for c in ax.collections if len(c.get_offsets())] + [np.empty(0)])
    if xs.size:
        pad = max(0.5, 0.06 * (xs.max() - xs.min()))
        ax.set_xlim(xs.min() - pad, xs.max() + pad)


def _plain_axes(ax, integer_x: bool = True) -> None:
    """Optuna's plots drawn like the report's others: white, a black frame and black text in the
    report's sizes (Optuna draws in ggplot's style, 10 pt and larger), whole trial numbers, and no
    marker on the frame."""
    from matplotlib.ticker import MaxNLocator

    ax.set_facecolor("white")  # Optuna draws in ggplot's grey
    for spine in ax.spines.values():
        spine.set_visible(True)
        spine.set_color("black")
        spine.set_linewidth(FIGURE_STYLE["axes.linewidth"])
    ax.tick_params(colors="black", labelsize=FIGURE_STYLE["xtick.labelsize"])
    for text, size in ((ax.title, "axes.titlesize"), (ax.xaxis.label, "axes.labelsize"), (ax.yaxis.label, "axes.labelsize")):
        text.set_color("black")
        text.set_fontsize(FIGURE_STYLE[size])
    ax.grid(True, color="#e5e5e5", linewidth=0.6)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(x=0.06, y=0.1)


def _restyle_importances(ax, method: str) -> None:
    for bar in ax.patches:
        bar.set_facecolor(method_style(method).color)
    _plain_axes(ax, integer_x=False)
    for text in ax.texts:  # Optuna's value labels sit on the bars' ends: a little gap, in black
        text.set_color("black")
        text.set_fontsize(FIGURE_STYLE["xtick.labelsize"])
        x, y = text.get_position()
        text.set_position((x + 0.01, y))
    ax.set_xlim(0, max(1.0, ax.get_xlim()[1]) * 1.08)
    ax.set_title(f"{name_of(method)}: parameter importance", loc="left")
    ax.set_xlabel("importance (normalised to sum to 1)")
    ax.set_ylabel("searched parameter")
    if ax.get_legend() is not None:  # one method: a legend of one entry says nothing the title does not
        ax.get_legend().remove()


def save(fig, out: Path, name: str) -> None:
    """``name``.png and ``name``.pdf in ``out``, each written atomically in ``figure_style`` (its
    TrueType fonts; ticks are made as they are drawn, in the sizes of that moment); the figure is
    closed.  The layout that drawing the first file computed is kept for the second: computing it
    again took a fifth of the report's time; in the PDFs of a digits sweep's figures it moved
    nothing by more than 1.4 pt (1/72 in), against a layout computed for the PDF itself."""
    import matplotlib.pyplot as plt

    with figure_style():
        for suffix in FORMATS:
            atomic_write(out / f"{name}.{suffix}", lambda handle: fig.savefig(handle, format=suffix, dpi=_PNG_DPI))
            fig.set_layout_engine("none")
    plt.close(fig)
