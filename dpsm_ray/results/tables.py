"""Tables of evaluation rows: mean and standard deviation over calibration/test re-splits."""

from __future__ import annotations

import pandas as pd

METRICS = ("coverage", "set_size", "covgap", "sscv", "wsc", "accuracy")


def summarise(evals: pd.DataFrame, by: tuple[str, ...] = ("score",)) -> pd.DataFrame:
    """Mean and standard deviation of every metric per group, as ``metric`` / ``metric_std`` columns."""
    grouped = evals.groupby(list(by), sort=False)[list(METRICS)]
    means, stds = grouped.mean(), grouped.std(ddof=1).fillna(0.0)
    out = means.copy()
    for metric in METRICS:
        out[f"{metric}_std"] = stds[metric]
    return out.reset_index()


def format_summary(summary: pd.DataFrame, by: tuple[str, ...] = ("score",)) -> str:
    """A plain-text table: one line per group, ``mean ± std`` per metric."""
    headers = [*by, "coverage", "set size", "CovGap %", "SSCV", "WSC", "accuracy"]
    lines = []
    for _, row in summary.iterrows():
        cells = [str(row[key]) for key in by]
        cells += [f"{row[m]:.3f} ± {row[m + '_std']:.3f}" if m != "covgap" else f"{row[m]:.2f} ± {row[m + '_std']:.2f}" for m in METRICS]
        lines.append(cells)
    return render_columns([headers, ["-" * len(h) for h in headers], *lines])


def render_columns(lines: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart; a row of dashes is widened to its column."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        cells = ["-" * w if set(c) == {"-"} else c for c, w in zip(line, widths)]
        out.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(out)
