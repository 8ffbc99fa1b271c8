"""How close a search of N trials gets to the best configuration: searches replayed hundreds of times on tables of real runs.

    python bench/search_quality.py --table digits=bench/results/search-grid-2026-11-29/digits.csv \\
        --table fashion_mnist=bench/results/search-grid-2026-11-29/fashion_mnist.csv --out-dir bench/results/search-quality-2026-11-29
    python bench/search_quality.py --quick --table tiny=PATH.csv --out-dir DIR      # the tests: 20 repetitions, budgets 2 and 4
    python bench/search_quality.py --report-from bench/results/search-quality-2026-11-29 [--figure]   # docs/sweeps.md's table (and
                                                              # regret.png), from the *quality.csv files there

Each table is ``bench/search_grid.py``'s: every cell of a grid over a method's knobs, trained once
(its validation set size and coverage, what a search sees; its test set size, what the user gets).
A replay runs one method's search through the service's own proposal path -- ``MethodStudy``, in
an in-memory Optuna storage -- for the largest budget: each proposal is answered with the table's
cell nearest to it (each knob's nearest grid value, in log scale), told as the sweep tells a trial
(its value, the coverage constraint, failed for a cell that failed), and after the first b trials
the pick is made by the sweep's rule (``dpsm_ray.sweep.pick``: the feasible trial with the smallest
validation set size, ties to the earlier; without one, the highest coverage).  Every repetition has
its own sweep seed.  The first b proposals of a replay are those of a search of b trials (the
random start is ``min(STARTUP_TRIALS, b)`` trials, the same for every b >= STARTUP_TRIALS; below it
every trial is random in both), so one replay gives the pick at every budget.

Per (table, method, sampler, budget): the pick's regret -- its validation set size against the best
feasible cell's, in percent -- as median and 10-90% band, how often the pick is feasible, and the
pick's test set size (median and band) beside the best feasible cell's.  Prints one JSON line and
the table; writes ``quality.csv``, ``quality.json`` and ``regret.png``/``.pdf`` (regret against
budget, a panel per table and method) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

from record import emit, listed, machine  # bench/record.py (bench/ is on the path of python bench/NAME.py)

SAMPLERS = ("tpe", "random", "sobol", "sobol-tpe", "gp")
BUDGETS = (2, 4, 8, 16, 32)
QUICK = {"repetitions": 20, "budgets": (2, 4), "samplers": ("tpe", "random", "sobol")}
# the digits sweep's slack (sweeps/digits.py) and the league's at alpha 0.01 (sweeps/league-fashion_mnist.yaml)
COVERAGE_SLACK = {"digits": 0.02, "fashion_mnist": 0.005}


def read_table(path: Path):
    import pandas as pd

    table = pd.read_csv(path)
    needed = {"method", "status", "val_set_size", "val_coverage", "test_set_size_hps"}
    if missing := needed - set(table.columns):
        raise SystemExit(f"--table {path}: not a search_grid table (no {', '.join(sorted(missing))})")
    return table


class Cells:
    """One method's cells of a table, looked up by the grid value nearest each knob (log scale)."""

    def __init__(self, rows, knobs: tuple[str, ...], floor: float) -> None:
        self.knobs, self.floor = knobs, floor
        self.values = {knob: np.sort(rows[knob].unique()) for knob in knobs}
        self.rows = {tuple(float(v) for v in row[list(knobs)]): row for _, row in rows.iterrows()}
        ok = rows[(rows.status == "ok") & (rows.val_coverage >= floor)]
        self.best = ok.sort_values("val_set_size").iloc[0] if len(ok) else None

    def nearest(self, params: dict) -> object:
        key = []
        for knob in self.knobs:
            grid = self.values[knob]
            key.append(float(grid[np.argmin(np.abs(np.log(grid) - math.log(params[knob])))]))
        return self.rows[tuple(key)]


def replay(cells: Cells, method: str, sampler: str, seed: int, budgets: tuple[int, ...]) -> list[dict]:
    """One search of ``max(budgets)`` trials through ``MethodStudy``; the pick at each budget."""
    import optuna

    from dpsm_ray.cards import DEFAULT_RANGES
    from dpsm_ray.sweep.search import MethodStudy

    total = max(budgets)
    study = MethodStudy(optuna.storages.InMemoryStorage(), f"replay-{seed}", method, {k: DEFAULT_RANGES[k] for k in cells.knobs},
                        sampler=sampler, seed=seed, total=total)
    told, picks = [], []
    for n in range(total):
        number, params = study.propose(set(range(n)))
        row = cells.nearest(params)
        ok = row.status == "ok" and math.isfinite(row.val_set_size)
        study.tell(number, status="ok" if ok else "failed", value=row.val_set_size if ok else None,
                   coverage=row.val_coverage if ok else None, floor=cells.floor, attributes={})
        told.append(row)
        if n + 1 in budgets:
            picks.append({"budget": n + 1, **pick(told, cells.floor)})
    return picks


def pick(rows: list, floor: float) -> dict:
    """The sweep's pick among ``rows`` (in proposal order): the feasible one with the smallest
    validation set size, ties to the earlier; else the highest coverage."""
    finished = [(i, r) for i, r in enumerate(rows) if r.status == "ok" and math.isfinite(r.val_set_size)]
    feasible = [(i, r) for i, r in finished if r.val_coverage >= floor]
    if feasible:
        _, chosen = min(feasible, key=lambda item: (item[1].val_set_size, item[0]))
    elif finished:
        _, chosen = min(finished, key=lambda item: (-item[1].val_coverage, item[0]))
    else:
        return {"val_set_size": math.nan, "test_set_size": math.nan, "feasible": False}
    return {"val_set_size": float(chosen.val_set_size), "test_set_size": float(chosen.test_set_size_hps),
            "feasible": bool(chosen.val_coverage >= floor)}


def quantiles(values) -> tuple[float, float, float]:
    values = np.asarray([v for v in values if math.isfinite(v)])
    if not len(values):
        return math.nan, math.nan, math.nan
    low, median, high = np.percentile(values, [10, 50, 90])
    return float(median), float(low), float(high)


def summarise(name: str, method: str, sampler: str, cells: Cells, picks: list[list[dict]], budgets) -> list[dict]:
    rows = []
    best = float(cells.best.val_set_size)
    for budget in budgets:
        at = [p for replayed in picks for p in replayed if p["budget"] == budget]
        regret = [100 * (p["val_set_size"] - best) / best if p["feasible"] else math.nan for p in at]
        median, low, high = quantiles(regret)
        test, test_low, test_high = quantiles([p["test_set_size"] for p in at])
        rows.append({"table": name, "method": method, "sampler": sampler, "budget": budget, "repetitions": len(at),
                     "regret_median": median, "regret_p10": low, "regret_p90": high,
                     "feasible_share": sum(p["feasible"] for p in at) / len(at),
                     "test_size_median": test, "test_size_p10": test_low, "test_size_p90": test_high,
                     "best_val_size": best, "best_test_size": float(cells.best.test_set_size_hps)})
    return rows


def figure(rows: list[dict], out_dir: Path) -> None:
    """Regret against budget: a row of panels per table, a panel per method, a line per sampler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = list(dict.fromkeys(r["table"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    samplers = list(dict.fromkeys(r["sampler"] for r in rows))
    budgets = sorted({r["budget"] for r in rows})
    fig, axes = plt.subplots(len(tables), len(methods), figsize=(3.0 * len(methods), 2.6 * len(tables)), squeeze=False)
    for row, table in enumerate(tables):
        for column, method in enumerate(methods):
            ax = axes[row][column]
            for sampler in samplers:
                mine = sorted((r for r in rows if (r["table"], r["method"], r["sampler"]) == (table, method, sampler)),
                              key=lambda r: r["budget"])
                if not mine:
                    continue
                at = [r["budget"] for r in mine]
                ax.plot(at, [r["regret_median"] for r in mine], marker="o", markersize=3, label=sampler)
                ax.fill_between(at, [r["regret_p10"] for r in mine], [r["regret_p90"] for r in mine], alpha=0.12)
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_title(f"{table}: {method}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(tables) - 1:
                ax.set_xlabel("trials")
        axes[row][0].set_ylabel("regret, % (median, 10-90%)")
    axes[-1][-1].legend(fontsize=8)
    fig.tight_layout()
    for suffix in ("png", "pdf"):
        fig.savefig(out_dir / f"regret.{suffix}", dpi=130)
    plt.close(fig)


def markdown(frame, budgets=(4, 8, 16)) -> str:
    """The median regret (10-90% band) of each sampler at ``budgets``, a row per table, method and
    sampler, and the share of feasible picks: what docs/sweeps.md quotes."""
    header = ["table", "method", "sampler", "repetitions", *(f"regret at {b} trials" for b in budgets), "feasible picks at 8"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (table, method, sampler), rows in frame.groupby(["table", "method", "sampler"], sort=False):
        at = rows.set_index("budget")
        cells = [f"{at.regret_median[b]:.2f}% [{at.regret_p10[b]:.2f}, {at.regret_p90[b]:.2f}]" if b in at.index else "—" for b in budgets]
        feasible = f"{at.feasible_share[8]:.0%}" if 8 in at.index else "—"
        lines.append("| " + " | ".join([table, method, sampler, str(int(rows.repetitions.iloc[0])), *cells, feasible]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--report-from"]:  # the committed results' table (and with --figure their figure), nothing replayed
        import pandas as pd

        if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] != "--figure"):
            raise SystemExit("usage: search_quality.py --report-from DIR [--figure] (DIR holds *quality.csv)")
        frame = pd.concat([pd.read_csv(path) for path in sorted(Path(argv[1]).glob("*quality.csv"))])
        # rows by table (as the files first give them), method, then sampler (SAMPLERS' order), whichever run added them
        order = {"table": list(dict.fromkeys(frame.table)), "sampler": list(SAMPLERS)}
        frame = frame.sort_values(["table", "method", "sampler", "budget"], kind="stable",
                                  key=lambda c: c.map(order[c.name].index) if c.name in order else c)
        print(markdown(frame), end="")
        if len(argv) == 3:
            figure(frame.to_dict("records"), Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--table", action="append", required=True, metavar="NAME=CSV",
                        help=f"a search_grid table and its dataset's name ({', '.join(COVERAGE_SLACK)}: its coverage slack); repeatable")
    parser.add_argument("--methods", help="comma-separated (default: every method of the tables)")
    parser.add_argument("--samplers", help=f"comma-separated (default: {','.join(SAMPLERS)}; quick: {','.join(QUICK['samplers'])})")
    parser.add_argument("--budgets", help=f"comma-separated (default: {','.join(map(str, BUDGETS))})")
    parser.add_argument("--repetitions", type=int, help="replays per (table, method, sampler), seeds 0..N-1 (default: 200)")
    parser.add_argument("--alpha", type=float, help="the tables' alpha (default: digits 0.1, fashion_mnist 0.01)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} (for the tests)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    samplers = listed(parser, "--samplers", args.samplers, SAMPLERS) if args.samplers else list(QUICK["samplers"] if args.quick else SAMPLERS)
    budgets = tuple(sorted(int(b) for b in args.budgets.split(","))) if args.budgets else (QUICK["budgets"] if args.quick else BUDGETS)
    repetitions = args.repetitions or (QUICK["repetitions"] if args.quick else 200)
    if min(budgets) < 1 or repetitions < 1:
        parser.error("--budgets and --repetitions must be integers >= 1")
    import optuna

    from dpsm_ray.cards import method_card

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, seconds = [], {}
    for spec in args.table:
        name, _, path = spec.partition("=")
        if not path:
            parser.error(f"--table {spec}: give NAME=CSV")
        table = read_table(Path(path))
        alpha = args.alpha or (0.01 if name == "fashion_mnist" else 0.1)
        floor = 1 - alpha - COVERAGE_SLACK.get(name, 0.0)
        methods = listed(parser, "--methods", args.methods, sorted(table.method.unique())) if args.methods else list(table.method.unique())
        for method in methods:
            cells = Cells(table[table.method == method], method_card(method).knobs, floor)
            if cells.best is None:
                print(f"{name} {method}: no feasible cell; left out", file=sys.stderr)
                continue
            for sampler in samplers:
                started = time.perf_counter()
                picks = [replay(cells, method, sampler, seed, budgets) for seed in range(repetitions)]
                seconds[f"{name}/{method}/{sampler}"] = round(time.perf_counter() - started, 1)
                rows += summarise(name, method, sampler, cells, picks, budgets)
                print(f"{name} {method} {sampler}: {repetitions} replays in {seconds[f'{name}/{method}/{sampler}']:.0f}s", file=sys.stderr)
    import pandas as pd

    from dpsm_ray.files import write_json, write_text

    frame = pd.DataFrame(rows)
    write_text(out_dir / "quality.csv", frame.to_csv(index=False, float_format="%.6g"))
    record = {"benchmark": "search_quality", "quick": args.quick, "tables": args.table, "repetitions": repetitions,
              "budgets": list(budgets), "samplers": samplers, "seconds": seconds, "machine": machine(), "rows": rows}
    write_json(out_dir / "quality.json", record)
    figure(rows, out_dir)
    emit({k: v for k, v in record.items() if k != "rows"}, args.json_out)
    print(f"{'table':<14} {'method':<7} {'sampler':<7} {'trials':>6} {'regret % median [10, 90]':>26} {'feasible':>8} "
          f"{'test size median':>16} {'best':>6}")
    for r in rows:
        band = f"{r['regret_median']:.2f} [{r['regret_p10']:.2f}, {r['regret_p90']:.2f}]"
        print(f"{r['table']:<14} {r['method']:<7} {r['sampler']:<7} {r['budget']:>6} {band:>26} {r['feasible_share']:>8.2f} "
              f"{r['test_size_median']:>16.4f} {r['best_test_size']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
