"""Tables of evaluation rows: mean and standard deviation over calibration/test re-splits; and
the test of a model at chance, which the report and ``dpsm-ray export`` warn of."""

from __future__ import annotations

import pandas as pd

from dpsm_ray.cards import BASE_MODEL, method_cards

_METRICS = ("coverage", "set_size", "covgap", "sscv", "wsc", "accuracy")
CHANCE_MARGIN = 0.05  # "near chance": test accuracy at most 5 points above 1/K


def chance_warning(accuracy: float, num_classes: int, set_size: float | None = None, measured: str = "test accuracy") -> str | None:
    """Why a model with top-1 test ``accuracy`` on ``num_classes`` classes (and average prediction
    set size ``set_size``, where known) is at or near chance, or None when it is not: its accuracy
    is at most CHANCE_MARGIN above 1/K, or every prediction set holds every class.  Its sets still
    cover as promised, by holding (nearly) every class: they say little about the label.
    ``measured``: what the accuracy is, in the reason's words."""
    if num_classes < 2:
        raise ValueError(f"chance_warning: num_classes must be >= 2; got {num_classes}")
    if set_size is not None and set_size >= num_classes - 1e-9:
        return f"every prediction set holds all {num_classes} classes"
    chance = 1 / num_classes
    if accuracy <= chance + CHANCE_MARGIN:
        return f"{measured} {accuracy:.3f}, at most {CHANCE_MARGIN:g} above chance (1/{num_classes} = {chance:.3f})"
    return None


def summarise(evals: pd.DataFrame, by: tuple[str, ...] = ("score",)) -> pd.DataFrame:
    """Mean and standard deviation of every metric per group, as ``metric`` / ``metric_std`` columns."""
    grouped = evals.groupby(list(by), sort=False)[list(_METRICS)]
    means, stds = grouped.mean(), grouped.std(ddof=1).fillna(0.0)
    out = means.copy()
    for metric in _METRICS:
        out[f"{metric}_std"] = stds[metric]
    return out.reset_index()


def format_summary(summary: pd.DataFrame, by: tuple[str, ...] = ("score",)) -> str:
    """A plain-text table: one line per group, ``mean ± std`` per metric ("n/a" where the metric
    is NaN on every row, as ``cell``)."""
    headers = [*by, "coverage", "set size", "CovGap %", "SSCV", "WSC", "accuracy"]
    lines = []
    for _, row in summary.iterrows():
        cells = [str(row[key]) for key in by]
        digits = {m: 2 if m == "covgap" else 3 for m in _METRICS}
        cells += ["n/a" if pd.isna(row[m]) else f"{row[m]:.{digits[m]}f} ± {row[m + '_std']:.{digits[m]}f}" for m in _METRICS]
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


# --- the report's tables ------------------------------------------------------------------------

_BASE_TITLES = ("CE (base model, as in the paper's table)", "CE base")  # the table's, the figures'


def method_order() -> tuple[str, ...]:
    """The report's order of methods: the CE base model, then the cards (dpsm_ray/cards/methods.py)."""
    return (BASE_MODEL, *(card.name for card in method_cards()))


def method_name(method: str) -> str:
    """A method's title in the tables (its card's); an unknown method its own name."""
    if method == BASE_MODEL:
        return _BASE_TITLES[0]
    return next((card.title for card in method_cards() if card.name == method), method)


def figure_name(method: str) -> str:
    """A method's tick label and legend entry: its card's short title, or its title."""
    if method == BASE_MODEL:
        return _BASE_TITLES[1]
    return next((card.short_title or card.title for card in method_cards() if card.name == method), method)
def ordered(values, order) -> list:
    present = list(dict.fromkeys(values))
    return [v for v in order if v in present] + [v for v in present if v not in order]


def cell(values: pd.Series, digits: int) -> str:
    """``mean ± std`` of ``values``, NaNs left out; "n/a" when every value is NaN (a WSC whose worst
    slab held no held-out test point, dpsm_ray/conformal/metrics.py)."""
    values = values.dropna()
    if values.empty:
        return "n/a"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1) if len(values) > 1 else 0.0:.{digits}f}"


def markdown(rows: list[list[str]]) -> str:
    header, *body = rows
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in body)])


# Unicode the tables hold and LaTeX's default fonts lack, as LaTeX
_LATEX_SYMBOLS = {
    "±": r"$\pm$",
    "−": "$-$",
    "↓": r"$\downarrow$",
    "↑": r"$\uparrow$",
    "×": r"$\times$",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
    "∈": r"$\in$",
    "α": r"$\alpha$",
    "λ": r"$\lambda$",
    "γ": r"$\gamma$",
    "η": r"$\eta$",
    "τ": r"$\tau$",
    "κ": r"$\kappa$",
    "…": r"\dots{}",
    "–": "--",
    "—": "---",
    "·": r"$\cdot$",
}


def latex_text(text: str) -> str:
    """``text`` as LaTeX: its special characters escaped, ``code`` and **bold** as \\texttt and
    \\textbf, the symbols of LATEX_SYMBOLS in math mode."""
    import re

    escaped = text.replace("\\", "\0")  # a placeholder: the braces of \textbackslash{} must not be escaped
    for char in "&%$#_{}":
        escaped = escaped.replace(char, "\\" + char)
    escaped = escaped.replace("\0", r"\textbackslash{}")
    escaped = escaped.replace("~", r"\textasciitilde{}").replace("^", r"\textasciicircum{}").replace("|", r"\textbar{}")
    for symbol, latex in _LATEX_SYMBOLS.items():
        escaped = escaped.replace(symbol, latex)
    escaped = re.sub(r"\*\*(.+?)\*\*", r"\\textbf{\1}", escaped)
    return re.sub(r"`(.+?)`", r"\\texttt{\1}", escaped)


def latex_table(rows: list[list[str]], caption: str, label: str, align: str | None = None, note: str | None = None) -> str:
    """A booktabs table (header, then body rows) in a floating ``table`` with its caption, and
    ``note`` under it in the float (a paragraph of the table, not of its caption)."""
    header, *body = rows
    align = align or "l" + "r" * (len(header) - 1)
    lines = [r"\begin{table}[htbp]", r"\centering", r"\small", rf"\caption{{{latex_text(caption)}}}", rf"\label{{tab:{label}}}",
             rf"\begin{{tabular}}{{{align}}}", r"\toprule", " & ".join(latex_text(c) for c in header) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_text(c) for c in row) + r" \\" for row in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    lines += [r"\par\smallskip\raggedright\footnotesize " + latex_text(note)] if note else []
    lines += [r"\end{table}"]
    return "\n".join(lines)


def calibration_rows(frame: pd.DataFrame, calibration: str = "marginal") -> pd.DataFrame:
    """The rows of evals.parquet or classes.parquet of one calibration (``CALIBRATIONS``)
    (rows written before the calibration was recorded, and a null, are marginal)."""
    if "calibration" not in frame:
        return frame if calibration == "marginal" else frame.iloc[:0]
    return frame[frame["calibration"].fillna("marginal") == calibration]
