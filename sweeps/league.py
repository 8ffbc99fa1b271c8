"""The league: every conformal training method searched and re-trained under one protocol, ranked against CE.

    python sweeps/league.py --dataset fashion_mnist          # the recipe of sweeps/league-fashion_mnist.yaml (docs/league.md)
    python sweeps/league.py --dataset fonts                  # sweeps/league-fonts.yaml
    python sweeps/league.py --dataset folder:PATH            # your own data, at the service's default recipe
    python sweeps/league.py --dataset fashion_mnist --resume # after an interruption
    python sweeps/league.py --report-from docs/results/league-fashion_mnist   # the table, from committed results
    python sweeps/league.py --report-from docs/results/league-fashion_mnist --ce-from docs/results/decisive-fashion_mnist
                                                             # and each method against that study's 8-trial CE
    python sweeps/league.py --report-from docs/results/league-fashion_mnist --ce-from docs/results/league-fashion_mnist-ce8
                                                             # and against CE searched again with --min-trials 8

A sweep (the service's own driver, every option of `dpsm-ray sweep`): the CE base model of each seed,
each method's Optuna search with 2 trials per knob, its pick re-trained with 10 seeds; then the league
table (dpsm_ray/results/league.py), printed, written to RESULTS/league.md and, with the rows it comes
from, to RESULTS/compact/ (small enough to commit; --report-from regenerates the table from it).
Options given here override the recipe's.
"""

import argparse
import re
import sys
from pathlib import Path

from dpsm_ray.sweep.cli import GENERIC_DEFAULTS, main as sweep

HERE = Path(__file__).resolve().parent
RECIPES = {name: HERE / f"league-{name}.yaml" for name in ("fashion_mnist", "fonts")}
# a dataset without a recipe: the service's defaults, and the league's protocol
METHODS = "ce,conftr,cut,dpsm,confts,vr_conftr,rwce"
PROTOCOL = ["--methods", METHODS, "--trials-per-knob", "2", "--final-seeds", "10", "--init", "base"]  # every method fine-tuned from one CE model


def results_dir(dataset: str) -> str:
    return "results/league-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset.replace(":", "-").split("/")[-1])


def other_ce_text(compact: tuple, folder: str) -> str:
    """The league ``compact`` against the CE of ``folder``: a study's searched CE (paired on the seeds
    whose base models both share), or another league's CE -- the league again with its CE where the
    base models are shared, else each method against it by the means over seeds."""
    from dpsm_ray.results.league import (against_other_ce, against_other_ce_markdown, against_unpaired_ce, against_unpaired_ce_markdown,
                                         analyse_league, league_markdown, read_league_compact, seeds_text, shared_base_seeds,
                                         with_other_ce)
    from dpsm_ray.results.studies import read_compact

    if not (Path(folder) / "league.json").is_file():
        return against_other_ce_markdown(against_other_ce(compact[0], read_compact(Path(folder))[0], compact[2]), f"`{folder}`")
    other = read_league_compact(folder)
    if not shared_base_seeds(compact[0], other[0]):  # no seed pairs: the means' comparison
        return against_unpaired_ce_markdown(against_unpaired_ce(compact[0], other[0], compact[2]), f"`{folder}`")
    merged, shared = with_other_ce(compact, other)
    return (f"With CE's search, pick and models from `{folder}`, on the {len(shared)} seeds whose CE base models the two share (seeds "
            f"{seeds_text(shared)}):\n\n" + league_markdown(analyse_league(*merged)))


def main(argv: list[str]) -> int:
    from dpsm_ray.files import write_text
    from dpsm_ray.results.league import analyse_league, league_markdown, read_league_compact, write_league_compact

    front = argparse.ArgumentParser(prog="sweeps/league.py", description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    front.add_argument("--dataset")
    front.add_argument("--report-from", metavar="FOLDER")
    front.add_argument("--ce-from", metavar="FOLDER", action="append", help="with --report-from, once or more: also each method against "
                       "a study's searched CE, or against CE of another league's compact folder (CE searched again): paired on the seeds "
                       "whose base models both share, else by the means over seeds")
    front.add_argument("--results-dir")
    known, rest = front.parse_known_args(argv)
    if known.ce_from and not known.report_from:
        front.exit(2, f"{front.prog}: error: --ce-from goes with --report-from\n")
    if known.report_from:
        if rest or known.dataset:
            front.exit(2, f"{front.prog}: error: --report-from prints a committed league's table; it takes no other option\n")
        try:
            compact = read_league_compact(known.report_from)
            print(league_markdown(analyse_league(*compact)), end="")
            for other in known.ce_from or []:
                print("\n" + other_ce_text(compact, other), end="")
        except (FileNotFoundError, ValueError) as error:
            front.exit(2, f"{front.prog}: error: {error}\n")
        return 0
    if known.dataset is None:
        front.exit(2, f"{front.prog}: error: --dataset is required: {', '.join(RECIPES)} (a recipe), or any dataset --dataset takes\n")
    calibrations = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    calibrations.add_argument("--eval-calibrations", nargs="*")
    asked = calibrations.parse_known_args(rest)[0].eval_calibrations
    if asked is not None and "marginal" not in asked:  # before any Ray work: the league would end with nothing to rank
        front.exit(2, f"{front.prog}: error: --eval-calibrations {' '.join(asked)}: the league ranks marginal sets; "
                      f"keep marginal (e.g. --eval-calibrations marginal class)\n")
    out = known.results_dir or results_dir(known.dataset)
    recipe = ["--config", str(RECIPES[known.dataset])] if known.dataset in RECIPES else ["--dataset", known.dataset, *PROTOCOL]
    status = sweep("league", __doc__.splitlines()[0], GENERIC_DEFAULTS, [*recipe, "--results-dir", out, *rest])
    if status == 0 and "--help" not in rest:  # the table from the compact rows it is committed as: --report-from gives the same text
        table = league_markdown(analyse_league(*read_league_compact(write_league_compact(out))))
        write_text(Path(out) / "league.md", table)
        print(table, end="")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
