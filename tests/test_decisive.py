"""The decisive test's analysis (dpsm_ray/sweep/study.py, sweeps/decisive.py) by hand: the
detectable effect, the batch-size gaps, the criterion's verdicts, the searched arms read from a
sweep, and the tables regenerated from the compact results."""

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.results.stats import detectable_effect
from dpsm_ray.results.studies import Arm, Study, analyse, analyse_tables, markdown_report, read_compact
from dpsm_ray.sweep.study import searched_arms
from dpsm_ray.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def sweep_script(name: str):
    """A script of sweeps/ as a module: the studies keep their arms there, as data."""
    sys.path.insert(0, str(ROOT / "sweeps"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


decisive = sweep_script("decisive")
DECISIVE_ANALYSIS, decisive_arms = decisive.DECISIVE_ANALYSIS, decisive.decisive_arms
SEEDS = (0, 1, 2)
# per arm: the HPS set size of each seed (APS: the same plus 0.1), identical on both re-splits
SIZES = {
    "ce": (2.0, 2.2, 2.1),
    "dpsm_l05": (1.8, 2.0, 1.9), "conftr_l05": (2.0, 2.2, 2.1), "cut_l05": (1.9, 2.1, 2.0),
    "dpsm_l05_b32": (1.8, 1.9, 1.9), "conftr_l05_b32": (2.4, 2.5, 2.3),
    "dpsm_l05_b512": (1.9, 2.0, 2.0), "conftr_l05_b512": (1.95, 2.05, 2.0),
    "searched_ce": (2.0, 2.1, 2.05), "searched_conftr": (1.9, 2.0, 1.95), "searched_cut": (2.1, 2.2, 2.1), "searched_dpsm": (1.7, 1.8, 1.75),
}


def study(common=None) -> Study:
    arms = {arm.name: arm for arm in decisive_arms()}
    chosen = tuple(arms.get(name) or Arm(name, name, {"method": name.split("_")[1]}) for name in SIZES)
    return Study(name="decisive-test", common=common or TrainConfig(dataset="digits", alpha=0.1, eval_splits=2), arms=chosen, seeds=SEEDS, **DECISIVE_ANALYSIS)


def tables(coverage=0.9):
    evals, runs = [], []
    for arm, sizes in SIZES.items():
        for seed, size in zip(SEEDS, sizes):
            for score, shift in (("hps", 0.0), ("aps", 0.1)):
                evals += [{"stage": arm, "seed": seed, "score": score, "split": split, "set_size": size + shift, "coverage": coverage, "covgap": 1.0, "accuracy": 0.8}
                          for split in (0, 1)]
            runs.append({"stage": arm, "seed": seed, "q": 0.5, "q_dataset_train": 0.5, "q_error_train": 0.01 * (seed + 1), "train_set_size_q": size,
                         "val_set_size": size, "q_error_train_all_epochs": 0.02})
    return pd.DataFrame(evals), pd.DataFrame(runs)


def test_the_detectable_effect_is_the_pre_registered_multiple_of_the_sd():
    # (t(0.975, 9) + t(0.8, 9)) / sqrt(10) = (2.262157 + 0.883404) / 3.162278 = 0.994714 (t tables)
    values = [float(v) for v in range(10)]
    sd = math.sqrt(sum((v - 4.5) ** 2 for v in values) / 9)
    assert detectable_effect(values) == pytest.approx(0.994714 * sd, rel=1e-5)
    assert math.isnan(detectable_effect([1.0]))


def test_the_batch_gaps_and_their_change_by_hand():
    analysis = analyse_tables(study(), *tables())
    batch = analysis["batch"]
    assert batch["batches"] == [32, 128, 512]
    gap = lambda conftr, dpsm: [100 * (c - d) / c for c, d in zip(SIZES[conftr], SIZES[dpsm])]
    small, middle, large = gap("conftr_l05_b32", "dpsm_l05_b32"), gap("conftr_l05", "dpsm_l05"), gap("conftr_l05_b512", "dpsm_l05_b512")
    hps = batch["scores"]["hps"]
    for row, expected in zip(hps["gaps"], (small, middle, large)):
        assert row["mean"] == pytest.approx(sum(expected) / 3) and row["seeds"] == 3
    change = [s - l for s, l in zip(small, large)]
    assert hps["difference"]["mean"] == pytest.approx(sum(change) / 3) and hps["difference"]["detectable"] == pytest.approx(detectable_effect(change))
    # the gap grows as the batch shrinks (means 22.1 > 9.5 > 1.7) and the interval of the change is above 0
    assert sum(small) > sum(middle) > sum(large) and hps["difference"]["low"] > 0 and hps["holds"] and not hps["contradicted"]
    assert [e["learned_q_error_train"] for e in batch["errors"]] == pytest.approx([0.02] * 3)


def test_the_claim_and_the_mechanism_verdicts_by_hand():
    analysis = analyse_tables(study(), *tables())
    claim = analysis["verdicts"]["claim"]
    # the best searched baseline is ConfTr's (1.95 HPS mean); DPSM is (1.75 - 1.95) / 1.95 = -10.3% smaller, every seed alike
    assert claim["hps"]["against"] == "searched_conftr" and claim["hps"]["mean"] == pytest.approx(100 * (1.75 - 1.95) / 1.95, abs=0.05)
    assert claim["verdict"] == "supported" and claim["hps"]["coverage_ok"]
    mechanism = analysis["verdicts"]["mechanism"]
    assert (mechanism["arm"], mechanism["against"]) == ("dpsm_l05", ["conftr_l05", "cut_l05"])  # the lambda 0.1 arms are absent
    assert mechanism["verdict"] == "holds"
    # coverage is a precondition: outside 1 - alpha +- 0.005 an arm's smaller sets do not count
    undercovered = analyse_tables(study(), *tables(coverage=0.88))["verdicts"]
    assert not undercovered["claim"]["hps"]["coverage_ok"] and undercovered["claim"]["verdict"] == "inconclusive"
    assert undercovered["mechanism"]["verdict"] == "not shown"
    report = markdown_report(analysis)
    assert "**The claim**" in report and "**supported**" in report and "gap(32) - gap(512)" in report and "holds" in report


def test_arms_the_comparisons_name_but_the_results_lack_are_named_as_absent():
    evals, runs = tables()
    evals, runs = evals[evals.stage != "cut_l05"], runs[runs.stage != "cut_l05"]
    # cut_l05 never ran; dpsm_l05_t1 failed on its only seed (reported with the failures, not as never run)
    failed = pd.DataFrame([{"stage": "dpsm_l05_t1", "seed": 0, "status": "failed", "error": "diverged"}])
    analysis = analyse_tables(study(), evals, runs, failed)
    # in the order the comparisons, then the mechanism, first name them (study() holds neither the lambda 0.1 arms nor these)
    assert analysis["absent"] == ["cut_l05", "dpsm_l01", "conftr_l01", "cut_l01", "dpsm_l05_ceb1", "dpsm_l005"]
    assert "mechanism" not in analysis["verdicts"]  # its only triple lacks cut_l05
    report = markdown_report(analysis)
    assert ("are not in these results (in no table, comparison or verdict): `cut_l05`, `dpsm_l01`, `conftr_l01`, `cut_l01`, "
            "`dpsm_l05_ceb1`, `dpsm_l005`.") in report
    assert "`dpsm_l05_t1` seed 0: diverged" in report
    assert "not in these results" not in markdown_report(analyse_tables(study(), *tables()) | {"absent": []})


def test_a_contradicted_claim():
    evals, runs = tables()
    # searched DPSM 2% smaller than searched ConfTr on every seed: the interval's lower end is above -5%
    evals.loc[evals.stage == "searched_dpsm", "set_size"] = evals[evals.stage == "searched_conftr"].set_size.to_numpy() * 0.98
    assert analyse_tables(study(), evals, runs)["verdicts"]["claim"]["verdict"] == "contradicted"


def test_a_comparison_over_fewer_than_two_seeds_prints_no_interval():
    from dpsm_ray.results.stats import summary
    from dpsm_ray.results.studies import detectable_text, interval_text

    # two seeds: mean 2, sd sqrt(2), half width t(0.975, 1) x sqrt(2) / sqrt(2) = 12.706
    assert interval_text(summary([1.0, 3.0])) == "+2.0% [-10.7, 14.7] (n.s.)"
    assert interval_text(summary([41.25])) == "+41.2% (1 seed: no interval)" and detectable_text(summary([41.25])) == "n/a"
    assert interval_text(summary([])) == "n/a (no seed)"


def test_the_tables_regenerate_from_the_compact_results(tmp_path):
    """The study's Parquet files -> compact/ -> fidelity.md; `sweeps/decisive.py --report-from
    compact/` prints the same tables (the command docs/fidelity.md's tables come from)."""
    evals, runs = tables()
    # conftr_l05's seed 2 diverged (no model); ce's seed 0 failed once and was trained again
    lost = lambda table: (table.stage == "conftr_l05") & (table.seed == 2)
    evals, runs = evals[~lost(evals)], runs[~lost(runs)]
    error = "dpsm_ray.train.loop.DivergedError: training loss is nan in epoch 1 (method conftr, lr 0.1)"
    pd.DataFrame([{"stage": "conftr_l05", "seed": 2, "status": "failed", "error": error},
                  {"stage": "ce", "seed": 0, "status": "failed", "error": "killed"},
                  {"stage": "ce", "seed": 1, "status": "ok", "error": None}]).to_parquet(tmp_path / "trials.parquet")
    rows = []
    for run in runs.to_dict("records"):  # two epochs per run: the compact file keeps the last, and the mean error over both
        rows += [{**run, "epoch": 1, "q_error_train": 0.5}, {**run, "epoch": 2}]
    evals.assign(run_id="x").to_parquet(tmp_path / "evals.parquet")
    pd.DataFrame(rows).drop(columns="q_error_train_all_epochs").to_parquet(tmp_path / "epochs.parquet")
    the_study = study(common=TrainConfig(dataset="fashion_mnist", alpha=0.01, eval_splits=10))
    analysis = analyse(the_study, tmp_path)
    compact_evals, compact_runs, arms, failed = read_compact(tmp_path / "compact")
    assert arms == the_study.arms
    assert failed.seed.tolist() == [0, 2] and analysis["failed"] == [{"arm": "conftr_l05", "seed": 2, "error": error}]
    report = (tmp_path / "fidelity.md").read_text()
    assert "(`conftr_l05`) | 2 of 3 |" in report and "(`ce`) | 3 |" in report
    assert f"ended without a model (in no table or comparison): `conftr_l05` seed 2: {error}." in report
    assert len(compact_evals) == len(evals) and list(compact_runs.columns)[-1] == "q_error_train_all_epochs"
    assert compact_runs.q_error_train_all_epochs.tolist() == pytest.approx([(0.5 + e) / 2 for e in runs.sort_values(["stage", "seed"]).q_error_train])
    assert json.loads((tmp_path / "fidelity.json").read_text())["verdicts"]["claim"]["verdict"] == analysis["verdicts"]["claim"]["verdict"]
    printed = subprocess.run([sys.executable, str(ROOT / "sweeps" / "decisive.py"), "--dataset", "fashion_mnist", "--report-from", str(tmp_path / "compact")],
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert printed.stdout == (tmp_path / "fidelity.md").read_text()


def test_report_now_without_a_study_is_a_one_line_error(tmp_path):
    printed = subprocess.run([sys.executable, str(ROOT / "sweeps" / "decisive.py"), "--dataset", "fashion_mnist", "--out", str(tmp_path / "none"),
                              "--report-now"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 2 and printed.stderr.strip().endswith(f"--report-now: no study in {tmp_path / 'none'} (no sweep.json naming arms)")
    assert not (tmp_path / "none").exists()


def test_arms_naming_a_searched_arm_without_its_sweep_says_what_it_needs(tmp_path):
    printed = subprocess.run([sys.executable, str(ROOT / "sweeps" / "decisive.py"), "--dataset", "fashion_mnist", "--out", str(tmp_path / "s"),
                              "--arms", "ce,searched_dpsm"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 2 and "--arms: unknown searched_dpsm; the arms are base, ce, " in printed.stderr
    assert printed.stderr.strip().endswith("cut_l01 (the searched arms need --searched-from)") and not (tmp_path / "s").exists()


def test_every_decisive_arm_is_a_valid_configuration_on_both_datasets():
    for name, definition in decisive.DATASETS.items():
        common = TrainConfig.from_dict(definition["common"])
        the_study = Study(name=name, common=common, arms=definition["arms"], seeds=(0,))
        configs = {arm.name: the_study.arm_config(arm) for arm in the_study.arms}
        assert configs["dpsm_l05"].sigmoid_temperature == 0.1 and configs["dpsm_l05"].ce_batch == "full" and configs["dpsm_l05"].batch_size == 128
        assert configs["dpsm_l05_ceb1"].ce_batch == "half" and configs["dpsm_l05_t1"].sigmoid_temperature == 1.0 and configs["dpsm_l005"].conformal_weight == 0.05
        assert (configs["conftr_l05_b32"].batch_size, configs["dpsm_l05_b512"].batch_size) == (32, 512)
        assert configs["dpsm_l05"].diagnostic_examples == 0  # |q - Q_n| over the whole training split
        arms = {arm.name for arm in the_study.arms}
        assert all(set(pair[1:]) <= arms for pair in definition["batch_pairs"]) and all(set(t) <= arms for t in definition["mechanism"])


def write_sweep(folder: Path, base: TrainConfig, methods=("ce", "dpsm"), grid=False, trials_per_knob=None) -> None:
    from dpsm_ray.sweep.spec import LEDGER_FORMAT

    folder.mkdir()
    (folder / "sweep.json").write_text(json.dumps({"base": json.loads(json.dumps(base.to_dict(), default=list)), "grid": grid, "methods": list(methods),
                                                   "trials": 2, "trials_per_knob": trials_per_knob, "ledger": LEDGER_FORMAT}))
    trials = []
    for method in methods:
        for index, (size, lr) in enumerate(((1.5, 0.01), (1.2, 0.03))):
            config = base.replace(method=method, lr=lr, conformal_weight=0.3 if method == "dpsm" else base.conformal_weight).to_dict()
            trials.append({"stage": "search", "method": method, "status": "ok", "feasible": True, "val_set_size": size, "val_coverage": 0.9,
                           "trial_index": index, "trial_id": f"{method}{index}", "epochs_completed": base.epochs, "config_json": json.dumps(config, default=list)})
    pd.DataFrame(trials).to_parquet(folder / "trials.parquet")


def test_the_searched_arms_are_each_methods_pick_from_its_sweep(tmp_path):
    common = TrainConfig(dataset="digits", alpha=0.1, epochs=3, batch_size=64)
    write_sweep(tmp_path / "sweep", common)
    arms = searched_arms(tmp_path / "sweep", common, log=lambda line: None)
    assert [arm.name for arm in arms] == ["searched_ce", "searched_dpsm"]
    # each at its pick (the finished feasible trial with the smallest validation set size), only the method's knobs
    assert arms[0].settings == {"method": "ce", "lr": 0.03}
    assert arms[1].settings["lr"] == 0.03 and arms[1].settings["conformal_weight"] == 0.3 and set(arms[1].settings) == {"method", "conformal_weight", "lr", "quantile_lr", "sigmoid_temperature"}
    assert [arm.title for arm in arms] == ["CE, searched (2 Optuna trials)", "DPSM, searched (2 Optuna trials)"]  # the cards' titles


def test_a_searched_arm_s_title_gives_its_own_budget_when_the_search_s_follows_the_knobs(tmp_path):
    """With --trials-per-knob 3 CE (1 knob) had 3 trials and DPSM (4 knobs) 12, whatever --trials said."""
    common = TrainConfig(dataset="digits", alpha=0.1, epochs=3, batch_size=64)
    write_sweep(tmp_path / "sweep", common, trials_per_knob=3)
    arms = searched_arms(tmp_path / "sweep", common, log=lambda line: None)
    assert [arm.title for arm in arms] == ["CE, searched (3 Optuna trials)", "DPSM, searched (12 Optuna trials)"]


def test_a_sweep_that_differs_from_the_study_is_refused_naming_the_setting(tmp_path):
    from dpsm_ray.sweep.spec import SweepError

    common = TrainConfig(dataset="digits", alpha=0.1, epochs=3, batch_size=64)
    write_sweep(tmp_path / "other", common.replace(alpha=0.05))
    with pytest.raises(SweepError, match=r"alpha=0.05.*the study with 0.1"):
        searched_arms(tmp_path / "other", common)
    write_sweep(tmp_path / "grid", common, grid=True)
    with pytest.raises(SweepError, match="--grid sweep"):
        searched_arms(tmp_path / "grid", common)
    with pytest.raises(SweepError, match="no sweep there"):
        searched_arms(tmp_path / "nothing", common)


@pytest.mark.parametrize("dataset", ["fashion_mnist", "fonts"])
def test_each_search_config_searches_at_the_study_s_settings(dataset):
    """sweeps/decisive-DATASET-search.yaml, read as the sweep reads it: its base shares every
    setting the searched arms need with the study (searched_arms would refuse it otherwise)."""
    from dpsm_ray.sweep.cli import config_options, GENERIC_DEFAULTS, build_parser, spec_from_args
    from dpsm_ray.sweep.options import GENERIC, parse_with_config
    from dpsm_ray.sweep.study import SHARED_WITH_THE_SWEEP

    def read(name, defaults):  # as `dpsm-ray sweep --config FILE` (or a sweep script's --config) reads it
        args = parse_with_config(build_parser(name, "", defaults), name, config_options(), ["--config", str(ROOT / "sweeps" / f"decisive-{dataset}-search.yaml")])
        return spec_from_args(name, args, defaults)

    spec = read(GENERIC, GENERIC_DEFAULTS)
    study = TrainConfig.from_dict(decisive.DATASETS[dataset]["common"])
    assert {name: getattr(spec.base, name) for name in SHARED_WITH_THE_SWEEP} == {name: getattr(study, name) for name in SHARED_WITH_THE_SWEEP}
    assert spec.methods == ("ce", "conftr", "cut", "dpsm") and spec.trials == 8 and not spec.grid and spec.seed == study.seed
    # the committed searches ran as `python sweeps/digits.py --config FILE`: the same sweep, only its name differs
    digits = sweep_script("digits")
    assert {**read("digits", digits.DEFAULTS).describe(), "name": GENERIC} == spec.describe()


def test_a_resumed_study_may_add_arms_or_run_a_subset_but_never_change_one(tmp_path):
    """A study is a sweep whose stages are its arms (the one driver, sweep.json its marker): resumed,
    it may add arms (the searched ones, once their sweep is done) or run a subset (--arms), and an arm
    of the same name must not change."""
    import dataclasses

    from dpsm_ray.sweep.spec import ResultsDirUnusable, check_results_dir, sweep_file
    from dpsm_ray.sweep.study import study_spec

    first = Study(name="s", common=TrainConfig(dataset="digits", alpha=0.1), arms=(Arm("ce", "CE", {"method": "ce"}), Arm("dpsm", "DPSM", {"method": "dpsm"})),
                  seeds=(0, 1))
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_file(study_spec(first), tmp_path)))
    def resumed(**changes):
        return check_results_dir(study_spec(dataclasses.replace(first, **changes)), tmp_path, resume=True)

    added = resumed(arms=(*first.arms, Arm("searched_dpsm", "searched", {"method": "dpsm", "lr": 0.03})))
    assert list(added["arms"]) == ["ce", "dpsm", "searched_dpsm"]  # the arms run now, and those it has had
    assert list(resumed(arms=first.arms[:1])["arms"]) == ["ce", "dpsm"]  # a subset: the others keep what they have
    for changes, named in [({"arms": (first.arms[0], Arm("dpsm", "DPSM", {"method": "dpsm", "conformal_weight": 0.5}))}, "arm dpsm:"),
                           ({"seeds": (0, 1, 2)}, "--final-seeds: 2 there, 3 here"), ({"common": TrainConfig(dataset="digits", alpha=0.05)}, "--alpha")]:
        with pytest.raises(ResultsDirUnusable, match=re.escape(named)):
            resumed(**changes)


# docs/fidelity.md quotes each study's tables (the decisive test's and round two's) between these lines, as the command prints them
GENERATED = re.compile(
    r"<!-- generated by: (?P<command>python sweeps/(?:decisive|round_two|round_three)\.py [^>]*?) -->\n(?P<text>.*?)<!-- end of generated -->\n",
    re.S,
)


def test_the_doc_s_study_tables_are_what_the_committed_results_regenerate():
    """Every table and number of docs/fidelity.md's decisive and round-two results traces to a committed file:
    each quoted block is exactly what its command prints from the compact results under docs/results/,
    and every committed study is quoted."""
    doc = (ROOT / "docs" / "fidelity.md").read_text()
    blocks = list(GENERATED.finditer(doc))
    results = ROOT / "docs" / "results"
    # round three keeps its two studies' compact results (one per backbone) in one folder
    committed = sorted(str(path.parent.relative_to(results)) for pattern in ("decisive-*/evals.csv", "round_two-*/evals.csv",
                                                                             "round_three-*/*/evals.csv") for path in results.glob(pattern))
    def folders(command: str) -> list[str]:  # every folder after --report-from (round two on fonts reads two)
        argv = shlex.split(command)
        return [str(Path(arg).relative_to("docs/results")) for arg in argv[argv.index("--report-from") + 1:]]

    quoted = sorted(name for block in blocks for name in folders(block["command"]))
    # round two on Fashion-MNIST and fonts also reads the leagues' committed searches (docs/results/league-*)
    assert committed and [name for name in quoted if not name.startswith("league-")] == committed
    assert all((results / name).is_dir() for name in quoted)
    for block in blocks:
        argv = shlex.split(block["command"])[1:]
        printed = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr[-2000:]
        assert block["text"] == printed.stdout, f"docs/fidelity.md's block differs from `{block['command']}`: regenerate it"



def test_a_second_backbone_re_trains_the_first_one_s_picks_on_one_split():
    """Round three: seeds 5-9 of every arm on backbone 1 re-train the picks searched on backbone 0
    (``differing``), and cut the data split of seed 0 (the common ``split_seed``)."""
    from dpsm_ray.results.studies import Arm, Study

    arm = Arm("ce", "CE fine-tuned", {"method": "ce"})
    second = Study("second", TrainConfig(dataset="digits", seed=5, split_seed=0), (arm,), seeds=(5, 6))
    assert second.arm_config(arm).split_seed == 0 and second.arm_config(arm).seed == 5
    first = Study("first", TrainConfig(dataset="digits", seed=5), (arm,), seeds=(5, 6))
    assert first.arm_config(arm).split_seed == 5  # as before: the study's first seed


def test_a_sweep_setting_named_as_differing_is_let_differ(tmp_path):
    """Round three re-trains backbone 0's picks on backbone 1 with ``differing=("pretrained_path",)``;
    here the same rule on a setting a digits config can vary: refused by name, then let through."""
    from dpsm_ray.sweep.spec import SweepError

    common = TrainConfig(dataset="digits", alpha=0.1, epochs=3, batch_size=64)
    write_sweep(tmp_path / "sweep", common)
    other = common.replace(base_lr=0.02)
    with pytest.raises(SweepError, match=r"its sweep ran with base_lr=None, the study with 0.02"):
        searched_arms(tmp_path / "sweep", other, log=lambda line: None)
    arms = searched_arms(tmp_path / "sweep", other, log=lambda line: None, differing=("base_lr",))
    assert [arm.name for arm in arms] == ["searched_ce", "searched_dpsm"]
