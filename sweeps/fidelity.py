"""Does conformal training change prediction sets offline, in the regime the paper studies? (issue 14)

    python sweeps/fidelity.py                  # the study (docs/fidelity.md: its run time on 2 CPU cores)
    python sweeps/fidelity.py --quick          # CI-sized: 20 classes, 3 trials a method, 2 seeds
    python sweeps/fidelity.py --out DIR [--resume] [--arms base,scratch] [--trials N] [--final-seeds S] [--seed S]

The paper's image benchmarks have many classes and a network that fits its training set far better
than new data (its training scores near 0, its calibration scores not), trained with augmentation.
The glyphs (``dpsm_ray/data/glyphs.py``) are such a set made offline: 100 classes, 20 training
images each, a small LeNet, random shifts.  The study runs the project's protocol -- as
``sweeps/digits.py`` runs it: an Optuna search per method on the validation split, the best
configuration of each method re-trained with ``--final-seeds`` seeds and evaluated over
calibration/test re-splits -- in two arms: ``base``, every method fine-tuned from a CE base model
(the official code), and ``scratch``, every method trained from scratch (the tex's table 5).  It
then reads each arm's Parquet files and reports:

1. the regime: training against calibration scores of every CE base model and final model;
2. each method's search: the best feasible validation set size after each trial (search-ARM.png);
3. the table: set size mean and std per method and score over seeds and re-splits, and DPSM's
   change against the best baseline (and each method's against CE) as the mean of per-seed
   percent changes with a 95% t interval over the seeds;
4. the quantile diagnostics of the final DPSM and ConfTr runs (epochs.parquet).

Writes ``OUT/<sweep>/`` per arm (the sweep's files, report.md and figures), ``OUT/search-ARM.png``,
``OUT/fidelity.json`` and ``OUT/fidelity.md`` (the tables, printed at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import pandas as pd

from dpsm_ray.results.report import METHOD_NAMES, METHOD_ORDER, SCORE_ORDER, markdown, ordered, paper_table
from dpsm_ray.sweep.cli import main as sweep_main
from dpsm_ray.sweep.space import METHOD_KNOBS, field_name

# The paper's schedules scaled down: its CIFAR base models train 164 epochs with the lr divided by
# 10 at 1/2 and 3/4 of them, its fine-tuning 40 epochs with one division at epoch 25.
COMMON = {
    "dataset": "glyphs",  # 100 classes, 20 training images each, noise 0.2
    "base_epochs": 60,
    "base_milestones": (30, 45),
    "lr_decay": 0.1,
    "batch_size": 64,
    "workers": 0,
    "cpus_per_worker": 1,
    "val_splits": 5,
    "eval_splits": 10,
}
# Two arms, the two readings of where training starts (issue 14): every method fine-tuned from one
# CE base model (the official code), and every method trained from scratch (the tex's table 5).
FULL = {
    "final_seeds": 5,
    # validation conformal on 500 + 500 images: the mean coverage over 5 re-splits of a calibrated
    # model has a standard deviation of about 0.008, so 0.02 rejects almost none by chance
    "coverage_slack": 0.02,
    "concurrency": 2,  # one trial per core, each with one thread
    "arms": {
        "base": {"trials": 20, "config": {**COMMON, "init": "base", "epochs": 15, "milestones": (10,)}},
        # a scratch trial costs ~2.3 fine-tuning trials (32 s against 14 s): 16 of them took the
        # study to 46 minutes on 2 cores, 12 keep it under 45 (docs/fidelity.md)
        "scratch": {"trials": 12, "config": {**COMMON, "init": "scratch", "epochs": 40, "milestones": (25, 35)}},
    },
}
QUICK_DATA = {"dataset": "glyphs:classes=20", "base_epochs": 20, "base_milestones": (10, 15), "val_splits": 3, "eval_splits": 5}
QUICK = {
    **FULL,
    "final_seeds": 2,
    "arms": {
        "base": {"trials": 3, "config": {**FULL["arms"]["base"]["config"], **QUICK_DATA, "epochs": 4, "milestones": (3,)}},
        "scratch": {"trials": 3, "config": {**FULL["arms"]["scratch"]["config"], **QUICK_DATA, "epochs": 12, "milestones": (8,)}},
    },
}
T_LEVEL = 0.95


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sweeps/fidelity.py", description=__doc__.splitlines()[0])
    quick_base = QUICK["arms"]["base"]
    parser.add_argument("--quick", action="store_true",
                        help=f"CI-sized: {quick_base['config']['dataset']}, {quick_base['trials']} trials a method, {QUICK['final_seeds']} seeds")
    parser.add_argument("--arms", default=",".join(FULL["arms"]), help="which arms to run, comma-separated: base (fine-tune a CE model), scratch (default: %(default)s)")
    parser.add_argument("--out", help="the study's directory (default: results/fidelity, or results/fidelity-quick)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted study in --out")
    parser.add_argument("--trials", type=int, help="Optuna trials per method in every arm (default: " + ", ".join(f"{arm} {spec['trials']}" for arm, spec in FULL["arms"].items())
                        + f"; quick: {quick_base['trials']})")
    parser.add_argument("--final-seeds", type=int, help=f"seeds each method's best configuration is re-trained with (default: {FULL['final_seeds']}; quick: {QUICK['final_seeds']})")
    parser.add_argument("--seed", type=int, default=0, help="sweep seed: data split, base models, TPE sampler (default: %(default)s)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arms if arm not in preset["arms"]]
    if unknown or not args.arms or len(set(args.arms)) != len(args.arms):
        parser.error(f"--arms must name some of {', '.join(preset['arms'])}, each once; got {','.join(args.arms) or 'none'}")
    args.out = Path(args.out or ("results/fidelity-quick" if args.quick else "results/fidelity")).resolve()
    args.final_seeds = preset["final_seeds"] if args.final_seeds is None else args.final_seeds
    if args.trials is not None and args.trials < 1:
        parser.error(f"--trials must be an integer >= 1; got {args.trials}")
    if args.final_seeds < 2:
        parser.error(f"--final-seeds must be an integer >= 2 (the interval is over seeds); got {args.final_seeds}")
    if args.out.exists() and any(args.out.iterdir()) and not args.resume:
        parser.error(f"--out {args.out} is not empty: pass --resume to continue the study there, or another --out")
    args.preset = preset
    return args


def arm_trials(args: argparse.Namespace, arm: str) -> int:
    return args.preset["arms"][arm]["trials"] if args.trials is None else args.trials


def run(args: argparse.Namespace, arm: str) -> Path:
    """One arm's sweep, through the sweep scripts' command line (the same checks, output and report)."""
    preset, trials = args.preset, arm_trials(args, arm)
    name = f"glyphs{'-quick' if args.quick else ''}-{arm}"
    results = args.out / name
    argv = ["--results-dir", str(results), "--trials", str(trials), "--final-seeds", str(args.final_seeds), "--seed", str(args.seed),
            "--coverage-slack", str(preset["coverage_slack"]), "--concurrency", str(preset["concurrency"])]
    # --resume continues an arm that had begun; an arm not yet begun starts afresh
    if args.resume and (results / "sweep.json").exists():
        argv.append("--resume")
    code = sweep_main(name, f"fidelity study, arm {arm}", {"trials": trials, "final_seeds": args.final_seeds, "config": preset["arms"][arm]["config"]}, argv)
    if code:
        raise SystemExit(code)
    return results


# ----------------------------------------------------------------------------- 1. the regime


def base_model_regime(results: Path) -> list[dict]:
    """Each CE base model's HPS scores in eval mode: Q_n of the training split (what DPSM's q and
    ConfTr's tau track) against the conformal quantile of the calibration split, and accuracies."""
    import torch

    from dpsm_ray.conformal import conformal_quantile, empirical_quantile, label_scores
    from dpsm_ray.data import load_splits
    from dpsm_ray.models import build_model
    from dpsm_ray.objectives import hps_scores
    from dpsm_ray.train.config import TrainConfig
    from dpsm_ray.train.env import LocalEnv
    from dpsm_ray.train.loop import predict

    env = LocalEnv(torch.device("cpu"))

    rows = []
    for entry in sorted((results / "base_models").glob("*/model.pt")):
        recorded = json.loads((entry.parent / "config.json").read_text())  # the config, its run id and split sizes
        config = TrainConfig.from_dict({name: value for name, value in recorded.items() if name in TrainConfig.__dataclass_fields__})
        data = load_splits(config.dataset, config.data_root, seed=config.data_seed())
        model = build_model(config.model, data.num_classes, input_shape=data.input_shape)
        model.load_state_dict(torch.load(entry, map_location="cpu", weights_only=True))
        row = {"seed": config.seed, "epochs": config.epochs}
        for split in ("train", "cal"):
            part = getattr(data, split)
            with torch.no_grad():
                logits = predict(model, part, torch.arange(len(part)), data.num_classes, env, config.precision).double()
            y = part.labels
            scores = label_scores(hps_scores(logits), y)
            row[f"{split}_accuracy"] = float((logits.argmax(1) == y).double().mean())
            row[f"{split}_median_score"] = float(scores.median())
            row[f"{split}_quantile"] = float(empirical_quantile(scores, 1 - config.alpha) if split == "train" else conformal_quantile(scores, config.alpha))
        rows.append(row)
    return sorted(rows, key=lambda row: row["seed"])


def last_epochs(epochs: pd.DataFrame) -> pd.DataFrame:
    """Each run's row of its last epoch."""
    return epochs.sort_values("epoch").groupby("run_id").tail(1)


def final_model_regime(epochs: pd.DataFrame, evals: pd.DataFrame) -> list[dict]:
    """The same contrast for the final models: Q_n of the training split at the last epoch
    (epochs.parquet) against the HPS calibration quantile of the test re-splits (evals.parquet)."""
    last = last_epochs(epochs)
    hps = evals[evals.score == "hps"]
    rows = []
    for method in ordered(evals.method, METHOD_ORDER):
        rows.append({
            "method": method,
            "train_quantile": float(last[last.method == method].q_dataset_train.mean()),
            "cal_quantile": float(hps[hps.method == method].q.mean()),
            "test_accuracy": float(hps[hps.method == method].accuracy.mean()),
        })
    return rows


# ----------------------------------------------------------------------------- 2. the search


def best_so_far(trials: pd.DataFrame) -> dict[str, list[float]]:
    """Per method, after each search trial in proposal order: the lowest validation set size of a
    finished feasible trial so far (NaN before the first)."""
    curves = {}
    search = trials[trials.stage == "search"]
    for method in ordered(search.method, METHOD_ORDER):
        best, curve = math.nan, []
        for row in search[search.method == method].sort_values("trial_index").itertuples():
            if row.status == "ok" and row.feasible and (math.isnan(best) or row.val_set_size < best):
                best = row.val_set_size
            curve.append(best)
        curves[method] = curve
    return curves


def search_summary(curves: dict[str, list[float]], trials: pd.DataFrame) -> list[dict]:
    """Per method: the trial the pick came from, and the best after half of the trials and at the end."""
    final = trials[trials.stage == "final"]
    rows = []
    for method, curve in curves.items():
        found = next((i for i, value in enumerate(curve) if value == curve[-1]), None)
        chosen = json.loads(final[final.method == method].config_json.iloc[0]) if (final.method == method).any() else {}
        rows.append({
            "method": method, "trials": len(curve), "best_found_at": None if found is None else found + 1,
            "best_at_half": curve[(len(curve) - 1) // 2], "best": curve[-1],
            "chosen": {field_name(knob): chosen.get(field_name(knob)) for knob in METHOD_KNOBS[method]},
        })
    return rows


def plot_search(curves: dict[str, list[float]], path: Path, arm: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axis = plt.subplots(figsize=(6, 4))
    for method, curve in curves.items():
        axis.step(range(1, len(curve) + 1), curve, where="post", label=METHOD_NAMES.get(method, method))
    axis.set_yscale("log")  # the first trials' sizes are often ten times the best
    for axis_format in (axis.yaxis.set_major_formatter, axis.yaxis.set_minor_formatter):
        axis_format(matplotlib.ticker.FormatStrFormatter("%g"))
    axis.set_xlabel("search trial")
    axis.set_ylabel("best feasible validation set size so far")
    axis.set_title(f"Arm {arm}: each method's search (is the pick stable?)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ----------------------------------------------------------------------------- 3. the table


def t_interval(values: list[float], level: float = T_LEVEL) -> tuple[float, float, float]:
    """Mean and the two ends of a Student t interval for the mean of ``values``."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_changes(evals: pd.DataFrame, method: str, against: str, score: str) -> dict:
    """``method``'s percent change of the set size against ``against``, per seed (both re-trained
    from that seed's base model and evaluated on the same re-splits), then a t interval over
    the seeds: the seeds are the independent replicates, a model's re-splits are not."""
    per_seed = evals[evals.score == score].groupby(["seed", "method"]).set_size.mean().unstack("method")
    change = (100 * (per_seed[method] - per_seed[against]) / per_seed[against]).dropna()
    mean, low, high = t_interval(change.tolist())
    return {"score": score, "method": method, "against": against, "seeds": len(change), "per_seed": [round(v, 2) for v in change],
            "mean": mean, "low": low, "high": high}


def changes(evals: pd.DataFrame) -> tuple[list[dict], list[dict]]:
    """DPSM against the best baseline per score (lowest mean set size: the paper table's rule), and
    every conformal method against CE."""
    scores = ordered(evals.score, SCORE_ORDER)
    baselines = [m for m in ordered(evals.method, METHOD_ORDER) if m != "dpsm"]
    best = []
    for score in scores:
        means = evals[evals.score == score].groupby("method").set_size.mean()
        if "dpsm" in means and baselines:
            best.append(paired_changes(evals, "dpsm", means.reindex(baselines).idxmin(), score))
    against_ce = [paired_changes(evals, method, "ce", score) for score in scores for method in ordered(evals.method, METHOD_ORDER) if method != "ce" and "ce" in set(evals.method)]
    return best, against_ce


def interval_text(change: dict) -> str:
    return f"{change['mean']:+.2f}% [{change['low']:+.2f}, {change['high']:+.2f}]"


# ----------------------------------------------------------------------------- 4. the diagnostics

DIAGNOSTICS = ("q", "q_dataset", "q_error", "q_dataset_train", "q_error_train", "upper_gap", "lower_gap", "train_set_size_q", "val_set_size")


def quantile_diagnostics(epochs: pd.DataFrame) -> list[dict]:
    """Mean over the final seeds of the last epoch's diagnostics, and of |q - Q_n| over all epochs."""
    rows = []
    for method in ("conftr", "dpsm"):
        runs = epochs[epochs.method == method]
        if runs.empty:
            continue
        last = last_epochs(runs)
        rows.append({"method": method, **{column: float(last[column].mean()) for column in DIAGNOSTICS},
                     "q_error_all_epochs": float(runs.q_error.mean()), "q_error_train_all_epochs": float(runs.q_error_train.mean())})
    return rows


# ----------------------------------------------------------------------------- the report


def fmt(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def write_markdown(study: dict) -> str:
    start = "fine-tuned from a CE base model" if study["init"] == "base" else "trained from scratch"
    lines = [f"### Arm `{study['arm']}`: every method {start}, {study['epochs']} epochs", "",
             f"Sweep `{study['results']}` on `{study['dataset']}`: {study['trials']} Optuna TPE trials per method, {study['final_seeds']} final seeds x "
             f"{study['eval_splits']} calibration/test re-splits, alpha {study['alpha']:g}.", ""]
    if study["base_models"]:  # none when every method trains from scratch
        lines += ["**Regime: the CE base models.** HPS scores 1 - p_y in eval mode: Q_n of the training split (0.9 quantile) "
                  "against the conformal quantile of the calibration split.", ""]
        rows = [["seed", "train accuracy", "train median score", "train Q_n", "cal accuracy", "cal median score", "cal q_hat"]]
        rows += [[str(r["seed"]), fmt(r["train_accuracy"]), fmt(r["train_median_score"], 4), fmt(r["train_quantile"], 4), fmt(r["cal_accuracy"]),
                  fmt(r["cal_median_score"], 4), fmt(r["cal_quantile"], 4)] for r in study["base_models"]]
        lines += [markdown(rows), ""]
    lines += ["**Regime: the final models** (mean over seeds): Q_n of the training split at the last epoch against the HPS "
              "calibration quantile of the test re-splits.", ""]
    rows = [["method", "train Q_n", "cal q_hat (HPS)", "test accuracy"]]
    rows += [[METHOD_NAMES[r["method"]], fmt(r["train_quantile"], 4), fmt(r["cal_quantile"], 4), fmt(r["test_accuracy"])] for r in study["final_models"]]
    lines += [markdown(rows), ""]
    lines += [f"**Search** (search-{study['arm']}.png): the lowest feasible validation set size after half of the trials and after all, the trial "
              "that found it, and the configuration re-trained.", ""]
    rows = [["method", "trials", "best at half", "best", "found at trial", "chosen"]]
    rows += [[METHOD_NAMES[r["method"]], str(r["trials"]), fmt(r["best_at_half"]), fmt(r["best"]), str(r["best_found_at"]),
              ", ".join(f"{k} {v:.3g}" for k, v in r["chosen"].items() if v is not None)] for r in study["search"]]
    lines += [markdown(rows), ""]
    lines += ["**Set size** (mean ± std over seeds x re-splits; the last row: the paper table's change of the means).", "", markdown(study["table"]), ""]
    lines += [f"**DPSM against the best baseline**: mean of the per-seed percent changes of the set size, with a {T_LEVEL:.0%} t interval "
              "over the seeds (negative: DPSM smaller).", ""]
    rows = [["score", "best baseline", "change [95% CI]", "per seed"]]
    rows += [[c["score"].upper(), METHOD_NAMES[c["against"]], interval_text(c), ", ".join(f"{v:+.1f}" for v in c["per_seed"])] for c in study["dpsm_vs_best"]]
    lines += [markdown(rows), ""]
    lines += ["**Each conformal method against CE** (the same per-seed changes and intervals).", ""]
    rows = [["score", *[METHOD_NAMES[m] for m in dict.fromkeys(c["method"] for c in study["vs_ce"])]]]
    for score in dict.fromkeys(c["score"] for c in study["vs_ce"]):
        rows.append([score.upper(), *[interval_text(c) for c in study["vs_ce"] if c["score"] == score]])
    lines += [markdown(rows), ""]
    lines += ["**Quantile diagnostics** of the final runs (epochs.parquet; last epoch, mean over seeds; |q - Q_n| also over all epochs).", ""]
    rows = [["method", *DIAGNOSTICS, "q_error all epochs", "q_error_train all epochs"]]
    rows += [[METHOD_NAMES[r["method"]], *[fmt(r[c], 4) for c in DIAGNOSTICS], fmt(r["q_error_all_epochs"], 4), fmt(r["q_error_train_all_epochs"], 4)]
             for r in study["diagnostics"]]
    lines += [markdown(rows), ""]
    lines += [f"Arm wall time {study['wall_seconds']:.0f} s."]
    return "\n".join(lines)


def analyse(results: Path, out: Path, args: argparse.Namespace, arm: str, wall: float) -> dict:
    trials = pd.read_parquet(results / "trials.parquet")
    epochs = pd.read_parquet(results / "epochs.parquet")
    evals = pd.read_parquet(results / "evals.parquet")
    final_epochs, final_evals = epochs[epochs.stage == "final"], evals[evals.stage == "final"]
    curves = best_so_far(trials)
    plot_search(curves, out / f"search-{arm}.png", arm)
    best, against_ce = changes(final_evals)
    config = args.preset["arms"][arm]["config"]
    return {
        "arm": arm, "results": results.name, "dataset": config["dataset"], "init": config["init"], "epochs": config["epochs"],
        "trials": arm_trials(args, arm), "final_seeds": args.final_seeds, "eval_splits": config["eval_splits"],
        "alpha": float(final_evals.alpha.iloc[0]), "seed": args.seed, "quick": args.quick,
        "base_models": base_model_regime(results), "final_models": final_model_regime(final_epochs, final_evals),
        "search": search_summary(curves, trials), "curves": curves,
        "table": paper_table(final_evals), "dpsm_vs_best": best, "vs_ce": against_ce,
        "diagnostics": quantile_diagnostics(final_epochs), "wall_seconds": wall,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    studies = {}
    for arm in args.arms:
        started = time.perf_counter()
        results = run(args, arm)
        studies[arm] = analyse(results, args.out, args, arm, time.perf_counter() - started)
    study = {"quick": args.quick, "seed": args.seed, "arms": studies, "wall_seconds": sum(s["wall_seconds"] for s in studies.values())}
    (args.out / "fidelity.json").write_text(json.dumps(study, indent=1, default=float) + "\n")
    text = "\n\n".join(write_markdown(arm_study) for arm_study in studies.values())
    text += f"\n\nThe whole study: {study['wall_seconds']:.0f} s."
    (args.out / "fidelity.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
