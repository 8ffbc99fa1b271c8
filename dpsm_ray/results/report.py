"""``dpsm-ray report DIR``: the paper-style table and figures from a results directory.

Works on a sweep's directory (final-stage rows) and on a single run's ``--out`` directory.
Table cells are mean ± std over every final model and calibration/test re-split.  Each figure is a
PNG in ``figures/`` and a section of report.md with one line on what it should show: the paper's
box plots (figure 1), losses and optimisation gaps (figure 2), |q - Q_n| and training against
validation set size (figure 3), and class-conditional coverage (figures 5-6).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dpsm_ray.files import CorruptFileError, atomic_write, write_text
from dpsm_ray.results.store import MANIFEST, verify_manifest
from dpsm_ray.results.tables import render_columns

METHOD_ORDER = ("base", "ce", "cut", "conftr", "conftr_published", "dpsm")
METHOD_NAMES = {
    "base": "CE (base model, as in the paper's table)", "ce": "CE", "cut": "CUT", "conftr": "ConfTr", "conftr_published": "ConfTr (published)",
    "dpsm": "DPSM",
}
FIGURE_NAMES = {**METHOD_NAMES, "base": "CE base", "conftr_published": "ConfTr (pub.)"}  # tick labels and legends
SCORE_ORDER = ("hps", "aps", "raps")
# epochs.parquet columns the curves average over a method's runs
EPOCH_CURVES = ("upper_loss", "lower_loss", "q_error", "q_error_train", "upper_gap", "lower_gap", "train_set_size_q", "val_set_size")


def load(results: Path, name: str) -> pd.DataFrame:
    path = results / name
    if not path.exists():
        return pd.DataFrame()
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise CorruptFileError(path, f"is not a readable Parquet file ({str(error).splitlines()[0][:160]})") from None
    if "stage" in frame and frame["stage"].notna().any():
        frame = frame[frame["stage"] == "final"] if name != "trials.parquet" else frame
    return frame


def ordered(values, order) -> list:
    present = list(dict.fromkeys(values))
    return [v for v in order if v in present] + [v for v in present if v not in order]


def cell(values: pd.Series, digits: int) -> str:
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.{digits}f}"


def paper_table(evals: pd.DataFrame, metric: str = "set_size", digits: int = 2) -> list[list[str]]:
    """Rows: methods; columns: scores; then DPSM's change against the best baseline trained by the
    same protocol (the base model excluded), and, where the base model was evaluated, against it:
    the paper's table compares DPSM with the CE base model, which was not fine-tuned (SPEC section 7)."""
    methods = ordered(evals["method"], METHOD_ORDER)
    scores = ordered(evals["score"], SCORE_ORDER)
    rows = [["method", *(s.upper() for s in scores)]]
    for method in methods:
        rows.append([METHOD_NAMES.get(method, method)] + [cell(evals[(evals.method == method) & (evals.score == s)][metric], digits) for s in scores])
    baselines = [m for m in methods if m not in ("dpsm", "base")]
    if "dpsm" in methods:
        for label, against in (("DPSM vs best baseline", baselines), ("DPSM vs the CE base model", ["base"] if "base" in methods else [])):
            if against:
                rows.append([label, *(percent_change(evals, metric, score, against) for score in scores)])
    return rows


def percent_change(evals: pd.DataFrame, metric: str, score: str, against: list[str]) -> str:
    """DPSM's mean ``metric`` against the lowest mean among the methods ``against``, in percent."""
    means = evals[evals.score == score].groupby("method")[metric].mean()
    best, ours = means.reindex(against).min(), means.get("dpsm", math.nan)
    if not (best > 0 and math.isfinite(ours)):  # a score some method lacks, or empty sets
        return "n/a"
    percent = 100.0 * (ours - best) / best
    return f"{'↓' if percent <= 0 else '↑'} {abs(percent):.2f}%"


def markdown(rows: list[list[str]]) -> str:
    header, *body = rows
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in body)])


def details_table(evals: pd.DataFrame) -> list[list[str]]:
    rows = [["method", "score", "coverage", "set size", "CovGap %", "SSCV", "WSC", "accuracy", "models"]]
    for method in ordered(evals["method"], METHOD_ORDER):
        for score in ordered(evals["score"], SCORE_ORDER):
            part = evals[(evals.method == method) & (evals.score == score)]
            rows.append([
                METHOD_NAMES.get(method, method), score.upper(), cell(part.coverage, 3), cell(part.set_size, 2), cell(part.covgap, 2),
                cell(part.sscv, 3), cell(part.wsc, 3), cell(part.accuracy, 3), str(part.run_id.nunique()),
            ])
    return rows


def write_report(results_dir: str | os.PathLike, log=print) -> str:
    """Print the tables, write ``report.md`` and ``figures/*.png``; returns the text printed."""
    results = Path(results_dir)
    for name in verify_manifest(results):
        log(f"warning: {results / name} has no checksum in {results / MANIFEST} (written by an earlier version); it is read unchecked")
    evals = load(results, "evals.parquet")
    if evals.empty:
        raise FileNotFoundError(f"no evaluation rows in {results / 'evals.parquet'}: is this a finished run or sweep directory?")
    alpha = float(evals.alpha.iloc[0])
    size, details = paper_table(evals), details_table(evals)
    text = "\n".join([
        f"Average prediction set size at alpha = {alpha:g} (mean ± std over models and calibration/test re-splits)",
        render_columns(size),
        "",
        "All metrics",
        render_columns(details),
    ])
    log(text)
    figures = write_figures(results, evals, load(results, "epochs.parquet"), load(results, "classes.parquet"), alpha)
    report = [f"# Results: {results.name}", "", f"Average prediction set size at alpha = {alpha:g}.", "", markdown(size), "", "## All metrics", "", markdown(details), ""]
    report += predictors_section(results, log)
    for figure in figures:
        report += [f"## {figure.title}", "", figure.caption, "", f"![{figure.title}](figures/{figure.name}.png)", ""]
    write_text(results / "report.md", "\n".join(report))
    log(f"report written to {results / 'report.md'} with {len(figures)} figures in {results / 'figures'}")
    return text


def predictors_section(results: Path, log) -> list[str]:
    """report.md's lines on the sweep's predictors (``dpsm_ray.export``): the one chosen per
    method, with its validation and test figures; none for a sweep without predictors."""
    from dpsm_ray.export import read_index

    index = read_index(results)
    if index is None:
        return []
    rows = [["predictor", "method", "seed", "val set size", "val coverage", "test coverage (HPS)", "test set size (HPS)"]]
    for method in ordered(list(index["chosen"]), METHOD_ORDER):
        entry = next(e for e in index["predictors"] if e["name"] == index["chosen"][method])
        hps = entry["test"]["scores"]["hps"]
        validation = ["n/a" if entry[key] is None else f"{entry[key]:.3f}" for key in ("val_set_size", "val_coverage")]  # none for a base model
        rows.append([f"`{entry['directory']}`", METHOD_NAMES.get(method, method), str(entry["seed"]), *validation,
                     f"{hps['coverage']:.3f}", f"{hps['set_size']:.2f}"])
        log(f"predictor of {method}: {results / entry['directory']} (dpsm-ray export {results} --method {method} --out DIR)")
    return [
        "## Predictors", "",
        f"Every final model is a conformal predictor under `predictors/` (docs/predictor.md), calibrated on the calibration split and "
        f"measured on the test split. Chosen per method: {index['rule']}.", "",
        markdown(rows), "",
        "`dpsm-ray export DIR --method METHOD --out OUT` copies the chosen one out (`--seed S` another); `dpsm-ray predict OUT --input X.npy "
        "--out sets.parquet` and `dpsm-ray serve OUT` use it.", "",
    ]


@dataclass(frozen=True)
class Figure:
    """A PNG in ``figures/`` and its section of report.md: a title and one line on what to see."""

    name: str
    title: str
    caption: str


def write_figures(results: Path, evals: pd.DataFrame, epochs: pd.DataFrame, classes: pd.DataFrame, alpha: float) -> list[Figure]:
    """Every figure the results have the columns for (older result files lack some)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = results / "figures"
    out.mkdir(exist_ok=True)
    methods = ordered(evals["method"], METHOD_ORDER)
    scores = ordered(evals["score"], SCORE_ORDER)
    written = []

    def name_of(method: str) -> str:
        return FIGURE_NAMES.get(method, method)

    def finish(fig, figure: Figure) -> None:
        fig.tight_layout()
        save(fig, out / f"{figure.name}.png")
        written.append(figure)

    for metric, title in (("coverage", "Coverage"), ("set_size", "Average prediction set size")):
        fig, axes = plt.subplots(1, len(scores), figsize=(4 * len(scores), 3.5), squeeze=False)
        for ax, score in zip(axes[0], scores):
            data = [evals[(evals.method == m) & (evals.score == score)][metric].to_numpy() for m in methods]
            ax.boxplot(data, tick_labels=[name_of(m) for m in methods])
            if metric == "coverage":
                ax.axhline(1 - alpha, color="grey", linestyle="--", linewidth=1)
            ax.set_title(f"{title} ({score.upper()})")
        if metric == "coverage":
            finish(fig, Figure("coverage_box", "Coverage", f"Test coverage over models and calibration/test re-splits (paper figure 1, top): every box should sit around 1 - alpha = {1 - alpha:g} (dashed)."))
        else:
            finish(fig, Figure("apss_box", "Average prediction set size", "Test APSS over models and re-splits (paper figure 1, bottom): at equal coverage, lower is better; the paper has DPSM's box lowest."))

    # load() has kept a sweep's final stage only: the curves of the chosen configurations
    if not epochs.empty:
        columns = [c for c in EPOCH_CURVES if c in epochs.columns]
        mean = epochs.groupby(["method", "epoch"], sort=True)[columns].mean().reset_index()
        quantile_methods = [m for m in ("dpsm", "conftr") if m in set(mean.method)]

        fig, (upper, lower) = plt.subplots(1, 2, figsize=(9, 3.5))
        for method in ordered(mean["method"], METHOD_ORDER):
            part = mean[mean.method == method]
            upper.plot(part.epoch, part.upper_loss, label=name_of(method))
            if part.lower_loss.notna().any():
                lower.plot(part.epoch, part.lower_loss, label=name_of(method))
        upper.set_title("Upper-level loss (CE + λ·L_c)")
        lower.set_title("Lower-level loss (pinball at q / τ)")
        for ax in (upper, lower):
            ax.set_xlabel("epoch")
            if ax.lines:
                ax.legend()
        finish(fig, Figure("losses", "Training losses", "Epoch means of the training objective and of the pinball loss on the training batches (paper figure 2(a)(b)): both should settle; DPSM's lower loss falls as q reaches the quantile."))

        if quantile_methods and {"upper_gap", "lower_gap"} <= set(columns):
            fig, (upper, lower) = plt.subplots(1, 2, figsize=(9, 3.5))
            for method in quantile_methods:
                part = mean[mean.method == method]
                upper.plot(part.epoch, part.upper_gap, label=name_of(method))
                lower.plot(part.epoch, part.lower_gap, label=name_of(method))
            upper.set_title("Upper loss at q minus at Q_n")
            lower.set_title("Pinball loss at q minus at Q_n")
            for ax in (upper, lower):
                ax.axhline(0, color="grey", linestyle="--", linewidth=1)
                ax.set_xlabel("epoch")
                ax.legend()
            finish(fig, Figure("loss_gaps", "Optimisation gaps", "The upper and lower losses on the training split at the learned quantile minus at its Q_n (paper figure 2(c)(d)): DPSM's gaps should fall to about 0 as q reaches Q_n; the pinball gap is never negative."))

        if quantile_methods:
            fig, ax = plt.subplots(figsize=(5.5, 3.5))
            for index, method in enumerate(quantile_methods):
                part, label = mean[mean.method == method], f"{name_of(method)} ({'learned q' if method == 'dpsm' else 'batch τ'})"
                if "q_error_train" in columns:
                    ax.plot(part.epoch, part.q_error_train, color=f"C{index}", label=f"{label}, Q_n of the training split")
                ax.plot(part.epoch, part.q_error, color=f"C{index}", linestyle="--", label=f"{label}, Q_n of D1")
            ax.set_xlabel("epoch")
            ax.set_ylabel("|q - Q_n|")
            ax.set_title("Quantile estimation error")
            ax.legend(fontsize="small")
            finish(fig, Figure("q_error", "Quantile estimation error", "|q - Q_n| with Q_n over the whole training split (solid, paper figure 3(a)) and over D1, the half q is fitted on (dashed): DPSM's learned q should approach Q_n and stay below ConfTr's batch-quantile error, starting above it from a random q_0; solid above dashed means the halves' scores have drifted apart."))

        if quantile_methods and "train_set_size_q" in columns:
            fig, (sizes, gaps) = plt.subplots(1, 2, figsize=(9, 3.5))
            for index, method in enumerate(quantile_methods):
                part, color = mean[mean.method == method], f"C{index}"
                sizes.plot(part.epoch, part.train_set_size_q, color=color, label=f"{name_of(method)} train, at q")
                sizes.plot(part.epoch, part.val_set_size, color=color, linestyle="--", label=f"{name_of(method)} validation")
                gaps.plot(part.epoch, (part.train_set_size_q - part.val_set_size).abs(), color=color, label=name_of(method))
            sizes.set_title("Set size: training split at q, validation")
            gaps.set_title("|train - validation| set size")
            for ax in (sizes, gaps):
                ax.set_xlabel("epoch")
                ax.legend()
            finish(fig, Figure("set_size_gap", "Training against validation set size", "The training split's hard set size at the learned quantile against the validation set size (paper figure 3(c), its learning-bound proxy): the smaller the gap, the better the training-time size predicts held-out size; the paper has DPSM's gap below ConfTr's."))

    if not classes.empty:
        # one value per final model and class: its mean over the re-splits
        per_class = classes.groupby(["method", "score", "run_id", "label"])[["coverage", "set_size"]].mean().reset_index()
        class_methods = ordered(per_class["method"], METHOD_ORDER)
        class_scores = ordered(per_class["score"], SCORE_ORDER)
        fig, axes = plt.subplots(2, len(class_scores), figsize=(4 * len(class_scores), 7), squeeze=False)
        for column, score in enumerate(class_scores):
            for row, (metric, title) in enumerate((("coverage", "Class-conditional coverage"), ("set_size", "Class-wise set size"))):
                ax = axes[row][column]
                data = [per_class[(per_class.method == m) & (per_class.score == score)][metric].dropna().to_numpy() for m in class_methods]
                ax.boxplot(data, tick_labels=[name_of(m) for m in class_methods])
                if metric == "coverage":
                    ax.axhline(1 - alpha, color="grey", linestyle="--", linewidth=1)
                ax.set_title(f"{title} ({score.upper()})")
        finish(fig, Figure("class_coverage", "Class-conditional coverage", f"Each class's test coverage and average set size, per final model and averaged over re-splits (paper figures 5-6): boxes tight around 1 - alpha = {1 - alpha:g} (dashed) mean even coverage across classes, lower set-size boxes smaller sets."))
    return written


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    atomic_write(path, lambda handle: fig.savefig(handle, format=path.suffix.lstrip("."), dpi=110))
    plt.close(fig)
