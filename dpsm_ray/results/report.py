"""``dpsm-ray report DIR``: the paper-style table and figures from a results directory.

Works on a sweep's directory (final-stage rows) and on a single run's ``--out`` directory.
Table cells are mean ± std over every final model and calibration/test re-split.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd

from dpsm_ray.results.tables import render_columns

METHOD_ORDER = ("ce", "cut", "conftr", "dpsm")
METHOD_NAMES = {"ce": "CE", "cut": "CUT", "conftr": "ConfTr", "dpsm": "DPSM"}
SCORE_ORDER = ("hps", "aps", "raps")


def load(results: Path, name: str) -> pd.DataFrame:
    path = results / name
    if not path.exists():
        return pd.DataFrame()
    frame = pd.read_parquet(path)
    if "stage" in frame and frame["stage"].notna().any():
        frame = frame[frame["stage"] == "final"] if name != "trials.parquet" else frame
    return frame


def ordered(values, order) -> list:
    present = list(dict.fromkeys(values))
    return [v for v in order if v in present] + [v for v in present if v not in order]


def cell(values: pd.Series, digits: int) -> str:
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.{digits}f}"


def paper_table(evals: pd.DataFrame, metric: str = "set_size", digits: int = 2) -> list[list[str]]:
    """Rows: methods; columns: scores; the last row: DPSM's change against the best baseline."""
    methods = ordered(evals["method"], METHOD_ORDER)
    scores = ordered(evals["score"], SCORE_ORDER)
    rows = [["method", *(s.upper() for s in scores)]]
    for method in methods:
        rows.append([METHOD_NAMES.get(method, method)] + [cell(evals[(evals.method == method) & (evals.score == s)][metric], digits) for s in scores])
    baselines = [m for m in methods if m != "dpsm"]
    if "dpsm" in methods and baselines:
        change = ["DPSM vs best baseline"]
        for score in scores:
            means = evals[evals.score == score].groupby("method")[metric].mean()
            best, ours = means.reindex(baselines).min(), means.get("dpsm", math.nan)
            if not (best > 0 and math.isfinite(ours)):  # a score some method lacks, or empty sets
                change.append("n/a")
                continue
            percent = 100.0 * (ours - best) / best
            change.append(f"{'↓' if percent <= 0 else '↑'} {abs(percent):.2f}%")
        rows.append(change)
    return rows


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
    figures = write_figures(results, evals, load(results, "epochs.parquet"), alpha)
    report = [f"# Results: {results.name}", "", f"Average prediction set size at alpha = {alpha:g}.", "", markdown(size), "", "## All metrics", "", markdown(details), ""]
    report += [f"![{name}](figures/{name}.png)" for name in figures]
    tmp = results / ".report.md.tmp"
    tmp.write_text("\n".join(report) + "\n")
    os.replace(tmp, results / "report.md")
    log(f"report written to {results / 'report.md'} with {len(figures)} figures in {results / 'figures'}")
    return text


def write_figures(results: Path, evals: pd.DataFrame, epochs: pd.DataFrame, alpha: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = results / "figures"
    out.mkdir(exist_ok=True)
    methods = ordered(evals["method"], METHOD_ORDER)
    scores = ordered(evals["score"], SCORE_ORDER)
    written = []

    for metric, title in (("coverage", "Coverage"), ("set_size", "Average prediction set size")):
        fig, axes = plt.subplots(1, len(scores), figsize=(4 * len(scores), 3.5), squeeze=False)
        for ax, score in zip(axes[0], scores):
            data = [evals[(evals.method == m) & (evals.score == score)][metric].to_numpy() for m in methods]
            ax.boxplot(data, tick_labels=[METHOD_NAMES.get(m, m) for m in methods])
            if metric == "coverage":
                ax.axhline(1 - alpha, color="grey", linestyle="--", linewidth=1)
            ax.set_title(f"{title} ({score.upper()})")
        fig.tight_layout()
        name = "coverage_box" if metric == "coverage" else "apss_box"
        save(fig, out / f"{name}.png")
        written.append(name)

    if "stage" in epochs.columns and (epochs.stage == "final").any():
        epochs = epochs[epochs.stage == "final"]  # a sweep: the curves of the chosen configurations
    if not epochs.empty:
        mean = epochs.groupby(["method", "epoch"], sort=True)[["upper_loss", "lower_loss", "q_error"]].mean().reset_index()
        fig, (upper, lower) = plt.subplots(1, 2, figsize=(9, 3.5))
        for method in ordered(mean["method"], METHOD_ORDER):
            part = mean[mean.method == method]
            upper.plot(part.epoch, part.upper_loss, label=METHOD_NAMES.get(method, method))
            if part.lower_loss.notna().any():
                lower.plot(part.epoch, part.lower_loss, label=METHOD_NAMES.get(method, method))
        upper.set_title("Upper-level loss (CE + λ·L_c)")
        lower.set_title("Lower-level loss (pinball at q / τ)")
        for ax in (upper, lower):
            ax.set_xlabel("epoch")
            if ax.lines:
                ax.legend()
        fig.tight_layout()
        save(fig, out / "losses.png")
        written.append("losses")

        quantile_methods = [m for m in ("dpsm", "conftr") if m in set(mean.method)]
        if quantile_methods:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for method in quantile_methods:
                part = mean[mean.method == method]
                ax.plot(part.epoch, part.q_error, label=f"{METHOD_NAMES[method]} ({'learned q' if method == 'dpsm' else 'batch τ'})")
            ax.set_xlabel("epoch")
            ax.set_ylabel("|q - Q_n|")
            ax.set_title("Quantile estimation error")
            ax.legend()
            fig.tight_layout()
            save(fig, out / "q_error.png")
            written.append("q_error")
    return written


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
