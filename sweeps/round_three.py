"""Round three of the fidelity study (docs/fidelity.md, "Round three": its criterion, written before
any of its runs): the paper's headline regime with room for the gain -- 79 Greek and Cyrillic classes
that the backbone never saw, few shots of each, two backbones.

    python sweeps/round_three.py --stage backbones --out results/round_three   # LeNet on the 62 digits and Latin letters, seeds 0 and 1
    python sweeps/round_three.py --stage regime --out results/round_three      # the shots: the first of 40, 20, 10 in the regime
    dpsm-ray sweep --config sweeps/round_three-search.yaml ...                 # the searches (that file says how)
    python sweeps/round_three.py --stage arms --out results/round_three        # the 10-seed arms, two studies of five
    python sweeps/round_three.py --report-from docs/results/round_three-fonts_transfer/backbone-0 \
        docs/results/round_three-fonts_transfer/backbone-1                    # the tables and verdicts, nothing trained
    python sweeps/round_three.py --stage backbones --quick                     # a smoke run (2 epochs) of a stage, into
    python sweeps/round_three.py --stage regime --quick                        #   results/round_three-quick

The stages run in the criterion's order, each on what the one before it wrote.  Every stage resumes:
run it again and what is done is read, not trained, and a run stopped part way continues from its
checkpoint.  One torch thread and no data workers, as a study's trials have
(``round_two.EVALUATION``): the thread count decides the sums' order, and with it the weights
(docs/fidelity.md, "2.79 against 2.97, measured").

- *backbones*: each backbone is the service's own command (docs/datasets.md), run in this process:

      dpsm-ray train --dataset fonts:classes=62,noise=20,eval=5 --method ce --model lenet --epochs 20 --milestones 10 15 \\
          --batch-size 64 --lr 0.05 --data-workers 0 --seed S --out OUT/backbones/seed-S        # S = 0, 1

  Seeds 0-4 of every arm use backbone 0, seeds 5-9 backbone 1.  ``OUT/backbones.json``: each one's
  test accuracy and sets on its own data (the held-out typefaces of its 62 classes).
- *regime*: for 40, 20 and 10 shots in that order, backbone 0's seed-0 CE base model -- the study's
  ``base`` arm, trained and evaluated by the code a study's trial runs (a new seeded head, 30 epochs,
  lr 0.01 divided by 10 at 15 and 25, batch 64; 10 calibration/test re-splits) -- until one is in
  the regime: test accuracy >= 0.75 and HPS sets at alpha 0.1 in [1.4, 3.5].  ``OUT/regime.json``:
  the table and the shots chosen (null: the regime is not reached, and round three stops there).
- *arms*: two studies (``dpsm_ray.sweep.study``) into OUT/arms/backbone-B, seeds 5B to 5B + 4 on
  backbone B, all on seed 0's data split: the base model, CE fine-tuned and the four searched picks
  of the committed search (``--searched-from`` docs/results/round_three-fonts_transfer/search-sweep),
  then the sharp arms at searched CE's lr one at a time, DPSM at T 0.01, CUT, DPSM at T 0.03: the
  reverse of the order the criterion cuts them in.  Each study's compact/ is what docs/results keeps.

Each stage's JSON records, for each run, the commit of the ``dpsm_ray`` it imported (and the tracked
files that differed from it), this script's sha256 and the wall seconds of the call that finished it.
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from round_two import CLAIM, DATASETS as ROUND_TWO

from dpsm_ray.results.studies import Arm

BACKBONE_DATA = "fonts:classes=62,noise=20,eval=5"  # the 62 digits and Latin letters of FONT_CLASSES
BACKBONE_SEEDS = (0, 1)
BACKBONE_TRAINING = ("--method", "ce", "--model", "lenet", "--epochs", "20", "--milestones", "10", "15", "--batch-size", "64",
                     "--lr", "0.05", "--data-workers", "0")
QUICK_BACKBONE = ("--epochs", "2", "--milestones", "1", "--train-subset", "1240")  # 20 images a class
SHOTS = (40, 20, 10)  # Caltech-101 has about 43 training images a class; fewer only if 40 is not in the regime
REGIME_ACCURACY = 0.75
REGIME_HPS = (1.4, 3.5)  # the paper's Caltech CE range (1.57 ResNet, 3.50 DenseNet), a little room below
BASE_ARM = Arm("base", "CE base model, not fine-tuned (the paper's CE column)", {"method": "base", "epochs": 0})
PREFIX = "round_three"


def target(shots: int) -> str:
    """The 79 Greek and Cyrillic classes, ``shots`` training images of each from the held-out faces."""
    return f"fonts_transfer:classes=79,first=62,shots={shots},eval=5,noise=20,backbone_classes=62"


def common_settings(shots: int, backbone: Path, quick: bool) -> dict:
    """The study's common settings on ``backbone``: round two's fonts_transfer recipe (the base
    model's schedule, the official fine-tuning schedule, the evaluation), on round three's target."""
    recipe = ROUND_TWO["fonts_transfer"]
    quick_settings = {k: v for k, v in recipe["quick"]["common"].items() if k != "dataset"} if quick else {}
    return {**recipe["common"], **quick_settings, "dataset": target(shots), "pretrained_path": str(backbone)}


# ----------------------------------------------------------------------------- records


def say(line: str) -> None:
    print(line, flush=True)


def source() -> dict:
    """What made the results: the commit of the imported ``dpsm_ray`` (with its tracked files that
    differ from it, none in a clean checkout) and this script's sha256."""
    import dpsm_ray
    from dpsm_ray.files import sha256_file

    tree = Path(dpsm_ray.__file__).resolve().parents[1]

    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *arguments], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "modified": git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "package": str(tree), "script": str(Path(__file__).resolve()), "script_sha256": sha256_file(__file__)}


def read_record(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def scores_summary(run: Path) -> dict:
    """A finished run's test metrics: the mean over its calibration/test re-splits of each score's
    set size and coverage, and the test accuracy."""
    import pandas as pd

    from dpsm_ray.storage.layout import PARQUET
    from dpsm_ray.results.tables import calibration_rows, summarise

    evals = calibration_rows(pd.read_parquet(run / PARQUET["evals"]))
    summary = summarise(evals).set_index("score")
    return {"accuracy": float(summary.loc["hps", "accuracy"]), "splits": int(evals.split.nunique()),
            **{f"{score}_set_size": float(row.set_size) for score, row in summary.iterrows()},
            **{f"{score}_coverage": float(row.coverage) for score, row in summary.iterrows()}}


def finished(run: Path) -> bool:
    from dpsm_ray.storage.layout import PARQUET

    return (run / PARQUET["classes"]).is_file()  # write_run's last file


# ----------------------------------------------------------------------------- the stages


def backbones(out: Path, quick: bool) -> dict:
    """Pretrain the backbones (``dpsm-ray train``, in this process) that are not finished; their
    test metrics on their own data."""
    from dpsm_ray.cli import PREDICTOR_DIR, main as dpsm_ray
    from dpsm_ray.files import write_json

    path = out / "backbones.json"
    record = read_record(path)
    for seed in BACKBONE_SEEDS:
        run = backbone_dir(out, seed)
        key = f"seed-{seed}"
        if finished(run) and (run / PREDICTOR_DIR).is_dir() and key in record.get("runs", {}):
            say(f"backbone {seed}: done ({run})")
            continue
        argv = ["train", "--dataset", BACKBONE_DATA, *BACKBONE_TRAINING, *(QUICK_BACKBONE if quick else ()), "--seed", str(seed),
                "--out", str(run)]
        resumed = (run / "checkpoint.pt").is_file()
        say(f"backbone {seed}: {'resuming' if resumed else 'training'}: dpsm-ray {shlex.join(argv)}")
        started = time.perf_counter()
        status = dpsm_ray(argv)
        seconds = time.perf_counter() - started
        if status:
            raise SystemExit(status)
        record.setdefault("runs", {})[key] = {"seed": seed, "dataset": BACKBONE_DATA, "command": f"dpsm-ray {shlex.join(argv)}",
                                              **scores_summary(run), "wall_seconds": seconds, "resumed": resumed, "source": source()}
        write_json(path, record)
        say(f"backbone {seed}: {seconds:.0f} s")
    say(backbones_table(record))
    return record


def backbone_dir(out: Path, seed: int) -> Path:
    return out / "backbones" / f"seed-{seed}"


def backbones_table(record: dict) -> str:
    lines = [f"backbones on {BACKBONE_DATA} (test split, mean over calibration/test re-splits, alpha 0.1)",
             "| backbone | test accuracy | HPS size (coverage) | APS size | RAPS size | wall time |", "|---|---|---|---|---|---|"]
    for run in (record["runs"][f"seed-{seed}"] for seed in BACKBONE_SEEDS if f"seed-{seed}" in record["runs"]):
        lines.append(f"| {run['seed']} | {run['accuracy']:.3f} | {run['hps_set_size']:.3f} ({run['hps_coverage']:.3f}) | "
                     f"{run['aps_set_size']:.3f} | {run['raps_set_size']:.3f} | {run['wall_seconds']:.0f} s |")
    return "\n".join(lines)


def regime(out: Path, quick: bool) -> dict:
    """The regime check: backbone 0's seed-0 CE base model at 40, 20, then 10 shots, until one is
    in the regime; the table, and the shots chosen (None if none is)."""
    from dpsm_ray.files import write_json

    backbone = backbone_dir(out, 0) / "model.pt"
    if not finished(backbone_dir(out, 0)):
        raise SystemExit(f"{PREFIX}: error: no backbone 0 in {backbone.parent}: run --stage backbones --out {out} first")
    path = out / "regime.json"
    record = read_record(path)
    record.update(criterion={"accuracy_at_least": REGIME_ACCURACY, "hps_set_size_between": list(REGIME_HPS), "alpha": 0.1,
                             "shots_in_order": list(SHOTS)}, backbone=str(backbone))
    runs = record.setdefault("runs", {})
    record["chosen_shots"] = None
    for shots in SHOTS:
        key = f"shots-{shots}"
        if key not in runs or not finished(regime_dir(out, shots)):
            runs[key] = {"shots": shots, **base_model_run(out, shots, backbone, quick), "source": source()}
            write_json(path, record)
        else:
            say(f"regime: {shots} shots: done ({regime_dir(out, shots)})")
        run = runs[key]
        say(f"regime: {shots} shots: test accuracy {run['accuracy']:.3f}, HPS {run['hps_set_size']:.3f}: "
            f"{'in' if run['in_regime'] else 'not in'} the regime")
        if run["in_regime"]:
            record["chosen_shots"] = shots
            break
    write_json(path, record)
    say(regime_table(record))
    return record


def regime_dir(out: Path, shots: int) -> Path:
    return out / "regime" / f"shots-{shots}"


def base_model_run(out: Path, shots: int, backbone: Path, quick: bool) -> dict:
    """Backbone 0's seed-0 CE base model at ``shots``, as a study's ``base`` arm trains and
    evaluates it (``Study.arm_config``; the base model cached under OUT/regime/base_models), in this
    process; its test metrics and whether it is in the regime."""
    from dpsm_ray.config import TrainConfig, check_pretrained
    from dpsm_ray.storage import write_run
    from dpsm_ray.results.studies import Study
    from dpsm_ray.train import run_training

    common = TrainConfig.from_dict(common_settings(shots, backbone, quick))
    study = Study(name=f"{PREFIX}-regime", common=common, arms=(BASE_ARM,), seeds=(common.seed,))
    config = study.arm_config(BASE_ARM, out / "regime")
    check_pretrained(config)
    run = regime_dir(out, shots)
    resumed = run.is_dir()  # a call before this one started it (its base model resumes from its checkpoint)
    run.mkdir(parents=True, exist_ok=True)
    say(f"regime: {shots} shots: backbone 0's seed-0 CE base model on {config.dataset} -> {run}")
    started = time.perf_counter()
    write_run(run, run_training(config, run, log=say))
    seconds = time.perf_counter() - started
    summary = scores_summary(run)
    low, high = REGIME_HPS
    in_regime = summary["accuracy"] >= REGIME_ACCURACY and low <= summary["hps_set_size"] <= high
    say(f"regime: {shots} shots: {seconds:.0f} s")
    return {"dataset": config.dataset, **summary, "in_regime": in_regime, "wall_seconds": seconds, "resumed": resumed}


def regime_table(record: dict) -> str:
    low, high = REGIME_HPS
    lines = [f"the regime check: backbone 0's seed-0 CE base model, 79 unseen classes (test split, mean over calibration/test re-splits, "
             f"alpha 0.1; in the regime: accuracy >= {REGIME_ACCURACY:g} and {low:g} <= HPS <= {high:g})",
             "| shots | test accuracy | HPS size (coverage) | APS size | RAPS size | in the regime | wall time |",
             "|---|---|---|---|---|---|---|"]
    for run in (record["runs"][f"shots-{shots}"] for shots in SHOTS if f"shots-{shots}" in record["runs"]):
        lines.append(f"| {run['shots']} | {run['accuracy']:.3f} | {run['hps_set_size']:.3f} ({run['hps_coverage']:.3f}) | "
                     f"{run['aps_set_size']:.3f} | {run['raps_set_size']:.3f} | {'yes' if run['in_regime'] else 'no'} | "
                     f"{run['wall_seconds']:.0f} s |")
    chosen = record["chosen_shots"]
    lines.append(f"chosen: {chosen} shots a class" if chosen is not None else
                 "no shots in the regime: round three reports these CE base models and stops (docs/fidelity.md)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the arms

SEARCH = Path(__file__).resolve().parents[1] / "docs" / "results" / "round_three-fonts_transfer" / "search-sweep"
SEEDS_PER_BACKBONE = 5  # seeds 0-4 on backbone 0, 5-9 on backbone 1
CE_ARM = Arm("ce", "CE fine-tuned", {"method": "ce"})
SEARCHED = ("searched_ce", "searched_conftr", "searched_cut", "searched_dpsm")
ANALYSIS = {
    "comparisons": (("searched_dpsm", "searched_ce"), ("searched_dpsm", "searched_conftr"), ("searched_dpsm", "searched_cut"),
                    ("dpsm_t001_l05", "cut_l05"), ("dpsm_t001_l05", "searched_ce"), ("dpsm_t003_l05", "searched_ce")),
    "mechanism": (("dpsm_t001_l05", "cut_l05"),),  # DPSM against CUT alone: round three has no sharp ConfTr arm
    "claim": CLAIM,
    "claim_rule": "round_three",
    "seed_groups": tuple(tuple(range(b * SEEDS_PER_BACKBONE, (b + 1) * SEEDS_PER_BACKBONE)) for b in BACKBONE_SEEDS),
}


def sharp_arms(lr: float) -> tuple[Arm, ...]:
    """The sharp proxy at searched CE's ``lr``, in the order the criterion cuts them last to first:
    DPSM (CE on the whole batch) at T 0.01, CUT, then DPSM at T 0.03, each at lambda 0.5."""
    def dpsm(temperature: float, tag: str) -> Arm:
        return Arm(f"dpsm_{tag}_l05", f"DPSM, CE on the whole batch, T {temperature:g}, lambda 0.5, lr {lr:g}",
                   {"method": "dpsm", "ce_batch": "full", "sigmoid_temperature": temperature, "conformal_weight": 0.5, "lr": lr})

    return (dpsm(0.01, "t001"), Arm("cut_l05", f"CUT, lambda 0.5, lr {lr:g}", {"method": "cut", "conformal_weight": 0.5, "lr": lr}),
            dpsm(0.03, "t003"))


def searched_ce_lr(common: dict) -> float:
    """The lr of searched CE's pick in the committed search (the sharp arms' lr)."""
    from dpsm_ray.config import TrainConfig
    from dpsm_ray.sweep.study import searched_arms

    config = TrainConfig.from_dict(common).with_absolute_paths()
    arms = {arm.name: arm for arm in searched_arms(SEARCH, config, log=lambda line: None, differing=("pretrained_path",))}
    return float(arms["searched_ce"].settings["lr"])


def arm_studies(out: Path, quick: bool, *, trained: bool = True) -> dict:
    """The two studies' definitions (``dpsm_ray.sweep.study.cli``'s): ``backbone-B``, seeds 5B to
    5B + 4 on backbone B, every seed on seed 0's data split; the references, the sharp arms, and
    (--searched-from) the searched ones.  ``trained``: the backbones must be in ``out`` (not for a
    report from compact results, which reads no model)."""
    chosen = read_record(out / "regime.json").get("chosen_shots")
    if chosen is None:
        raise SystemExit(f"{PREFIX}: error: {out / 'regime.json'} names no shots in the regime: run --stage regime --out {out} first "
                         "(round three stops where none is)")
    definitions = {}
    for b in BACKBONE_SEEDS:
        if trained and not finished(backbone_dir(out, b)):
            raise SystemExit(f"{PREFIX}: error: no backbone {b} in {backbone_dir(out, b)}: run --stage backbones --out {out} first")
        common = {**common_settings(chosen, backbone_dir(out, b) / "model.pt", quick), "seed": b * SEEDS_PER_BACKBONE, "split_seed": 0}
        definitions[f"backbone-{b}"] = {
            "common": common, "arms": (BASE_ARM, CE_ARM, *sharp_arms(searched_ce_lr({**common, "seed": 0}))),
            "seeds": SEEDS_PER_BACKBONE, "concurrency": 2, "prefix": PREFIX, "differing": ("pretrained_path",),
            "quick": {"common": {k: v for k, v in ROUND_TWO["fonts_transfer"]["quick"]["common"].items() if k != "dataset"}, "seeds": 2,
                      "epochs": 2, "milestones": (1,)},
            **ANALYSIS,
        }
    return definitions


def arm_phases(quick: bool) -> list[tuple[str, ...]]:
    """The arms each call runs, cumulative, in the criterion's order: the references and the searched
    arms; then the sharp arms one at a time, the first cut last (a smoke run has no searched arms)."""
    first = ("base", "ce", *(() if quick else SEARCHED))
    return [first, (*first, "dpsm_t001_l05"), (*first, "dpsm_t001_l05", "cut_l05"), (*first, "dpsm_t001_l05", "cut_l05", "dpsm_t003_l05")]


def arms(out: Path, quick: bool) -> dict:
    """The 10-seed arms: each phase on backbone 0, then on backbone 1 (``dpsm_ray.sweep.study.cli``,
    in this process, into OUT/arms/backbone-B); a phase run already is read, not trained."""
    from dpsm_ray.sweep.study import cli

    definitions = arm_studies(out, quick)
    for phase in arm_phases(quick):
        for name in definitions:
            folder = out / "arms" / name
            argv = ["--dataset", name, "--out", str(folder), "--arms", ",".join(phase), *(["--quick"] if quick else []),
                    *([] if quick else ["--searched-from", str(SEARCH)]), *(["--resume"] if (folder / "sweep.json").is_file() else [])]
            say(f"arms: {name}: {', '.join(phase)}: sweeps/round_three.py {shlex.join(argv)}")
            started = time.perf_counter()
            status = cli(f"{PREFIX} arms", "round three's arms", definitions, argv)
            if status:
                raise SystemExit(status)
            say(f"arms: {name}: {', '.join(phase)}: {time.perf_counter() - started:.0f} s")
    return definitions


STAGES = {"backbones": backbones, "regime": regime, "arms": arms}  # in the criterion's order
COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "results" / "round_three-fonts_transfer"


def report(folders: list[str]) -> int:
    """The arms' tables and verdicts from the two studies' compact results, read as one study of
    10 seeds (``read_study_folders`` joins each arm's seeds), then round three's row of the verdict
    table per regime (docs/fidelity.md): nothing is trained."""
    from dpsm_ray.sweep.study import cli

    definitions = arm_studies(COMMITTED, False, trained=False)
    status = cli("sweeps/round_three.py", "round three's arms", definitions, ["--dataset", "backbone-0", "--report-from", *folders])
    if status == 0:
        say(verdict_row(folders))
    return status


def verdict_row(folders: list[str]) -> str:
    """Round three's row of docs/fidelity.md's verdict table per regime, from the compact results."""
    import dataclasses

    from dpsm_ray.cards import method_card
    from dpsm_ray.results.studies import analyse_tables, interval_text, read_study_folders
    from dpsm_ray.sweep.study import study_from_args, study_parser

    definitions = arm_studies(COMMITTED, False, trained=False)
    parser = study_parser("sweeps/round_three.py", "round three's arms", definitions)
    study = study_from_args(parser.parse_args(["--dataset", "backbone-0"]), definitions["backbone-0"], parser)
    evals, runs, arms, failed, _ = read_study_folders(folders)
    analysis = analyse_tables(dataclasses.replace(study, arms=arms), evals, runs, failed)
    claim = analysis["verdicts"].get("claim")
    base = next((row["hps"]["set_size"] for row in analysis["table"] if row["arm"] == "base"), None)
    shots = read_record(COMMITTED / "regime.json")["chosen_shots"]
    backbones = sum(1 for seeds in study.seed_groups if set(seeds) & set(evals.seed))
    cells = ["small data, classes the backbone never saw (round three)",
             f"`fonts_transfer`, 79 unseen classes, {shots} shots, {backbones} backbone{'s' * (backbones != 1)}",
             "n/a" if base is None else f"{base:.2f}", "50.0% (Caltech-101)"]
    if claim is None:
        cells += ["not judged: no searched DPSM and baseline in these results"] + ["n/a"] * 3
    else:
        names = {arm: method_card(arm.removeprefix("searched_")).title for arm in (claim["hps"]["against"], claim["aps"]["against"])}
        cells += [claim["verdict"], f"**{claim['verdict']}**", f"{names[claim['hps']['against']]} / {names[claim['aps']['against']]}",
                  f"{interval_text(claim['hps'])} / {interval_text(claim['aps'])}"]
    return "Round three's row of the verdict table per regime:\n\n| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="sweeps/round_three.py", description=__doc__.splitlines()[0], allow_abbrev=False)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--stage", choices=list(STAGES), help="the stage to run (each reads what the ones before wrote)")
    what.add_argument("--report-from", nargs="+", metavar="FOLDER",
                      help="print the arms' tables and verdicts from the two studies' compact/ folders (e.g. the committed copies "
                           f"under {COMMITTED.relative_to(COMMITTED.parents[2])}/) and exit: nothing is trained")
    parser.add_argument("--results-dir", "--out", dest="out", metavar="DIR",
                        help=f"the round's directory (default: results/{PREFIX}[-quick])")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 epochs, the backbones on 20 images a class")
    args = parser.parse_args(argv)
    if args.report_from:
        return report(args.report_from)
    out = Path(args.out or f"results/{PREFIX}{'-quick' if args.quick else ''}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # as a study's trial (one CPU, one thread): the same sums in the same order
    found = source()
    say(f"{PREFIX}: stage {args.stage} into {out}; dpsm_ray at {found['commit']} ({found['package']}"
        f"{', modified: ' + ', '.join(found['modified']) if found['modified'] else ''}), script sha256 {found['script_sha256']}")
    started = time.perf_counter()
    STAGES[args.stage](out, args.quick)
    say(f"{PREFIX}: stage {args.stage} finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
