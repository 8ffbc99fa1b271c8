"""Round two's arms and searches (sweeps/round_two.py, docs/fidelity.md "Round two"): what the
criterion names, in the order its budget rule needs, at the settings its searches share."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpsm_ray.config import TrainConfig
from dpsm_ray.results.studies import Study

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sweeps"))
try:
    import round_two
finally:
    sys.path.pop(0)


def configs(dataset: str) -> dict[str, TrainConfig]:
    definition = round_two.DATASETS[dataset]
    study = Study(name=dataset, common=TrainConfig.from_dict(definition["common"]), arms=definition["arms"], seeds=(0,))
    return {arm.name: study.arm_config(arm) for arm in study.arms}


@pytest.mark.parametrize("dataset", ["fonts_transfer", "fonts"])
def test_the_sharp_arms_are_the_criterion_s_at_one_lr_in_the_cut_order(dataset):
    arms = configs(dataset)
    sharp = {name: config for name, config in arms.items() if name not in ("base", "ce")}
    assert len(sharp) == 10 and {config.lr for config in sharp.values()} == {round_two.SHARP_LR[dataset]}
    assert round_two.SHARP_LR == {"fonts_transfer": 0.01, "fonts": 0.001}  # the pilot's outcome in each regime
    grid = {(c.method, c.sigmoid_temperature if c.method != "cut" else None, c.conformal_weight) for c in sharp.values()}
    assert grid == {(m, t, w) for m in ("dpsm", "conftr") for t in (0.01, 0.03) for w in (0.5, 0.1)} | {("cut", None, 0.5), ("cut", None, 0.1)}
    assert all(c.ce_batch == "full" for c in sharp.values() if c.method == "dpsm")  # the size term on, as in the first round
    assert all(c.diagnostic_examples == 0 and c.cpus_per_worker == 1 and c.data_workers == 0 for c in arms.values())
    order = list(arms)
    assert order[:2] == ["base", "ce"]
    # the budget rule cuts the lambda 0.1 arms first, then the T 0.03 ones: they run last, in that order
    lambda01 = [i for i, name in enumerate(order) if name.endswith("_l01")]
    t003_l05 = [order.index(name) for name in ("dpsm_t003_l05", "conftr_t003_l05")]
    assert min(lambda01) > max(t003_l05) > max(order.index(n) for n in ("dpsm_t001_l05", "conftr_t001_l05", "cut_l05"))
    names = set(order)
    assert all(set(t) <= names for t in round_two.ANALYSIS["mechanism"])
    assert all(set(pair) <= names | {"searched_ce", "searched_conftr", "searched_cut", "searched_dpsm"} for pair in round_two.ANALYSIS["comparisons"])


def test_the_transfer_study_fine_tunes_from_base_models_on_the_backbone():
    arms = configs("fonts_transfer")
    ce = arms["ce"]
    assert ce.dataset == "fonts_transfer" and ce.model == "lenet" and ce.pretrained_path.endswith("runs/fonts-backbone/model.pt")
    assert (ce.base_epochs, ce.base_milestones, ce.base_lr, ce.base_batch_size) == (30, (15, 25), 0.01, 64)
    assert (ce.init, ce.epochs, ce.batch_size, ce.lr, ce.milestones) == ("base", 40, 128, 0.1, (25,))


def test_the_transfer_search_config_searches_at_the_study_s_settings_with_the_fair_budget():
    from dpsm_ray.sweep.cli import config_options, GENERIC_DEFAULTS, build_parser, spec_from_args
    from dpsm_ray.sweep.options import GENERIC, parse_with_config
    from dpsm_ray.sweep.study import SHARED_WITH_THE_SWEEP

    config = ROOT / "sweeps" / "round_two-fonts_transfer-search.yaml"
    args = parse_with_config(build_parser(GENERIC, "", GENERIC_DEFAULTS), GENERIC, config_options(), ["--config", str(config)])
    spec = spec_from_args(GENERIC, args, GENERIC_DEFAULTS)
    study = TrainConfig.from_dict(round_two.DATASETS["fonts_transfer"]["common"]).with_absolute_paths()  # as the study compares them
    assert "pretrained_path" in SHARED_WITH_THE_SWEEP  # a search on another backbone is not this study's
    assert {name: getattr(spec.base, name) for name in SHARED_WITH_THE_SWEEP} == {name: getattr(study, name) for name in SHARED_WITH_THE_SWEEP}
    assert spec.methods == ("ce", "conftr", "cut", "dpsm") and spec.trials_per_knob == 2 and spec.seed == study.seed
    assert {method: spec.search_trials(method) for method in spec.methods} == {"ce": 2, "conftr": 6, "cut": 4, "dpsm": 8}


def test_the_fonts_arms_fine_tune_from_the_fonts_league_s_base_models():
    """Read as one study with the league (``--report-from`` both folders), the two share each seed's
    base model: one cache entry, though the league scores its diagnostics on a sample."""
    from dpsm_ray.sweep.cli import config_options, GENERIC_DEFAULTS, build_parser, spec_from_args
    from dpsm_ray.sweep.options import GENERIC, parse_with_config
    from dpsm_ray.train.base_model import cache_entry

    config = ROOT / "sweeps" / "league-fonts.yaml"
    args = parse_with_config(build_parser(GENERIC, "", GENERIC_DEFAULTS), GENERIC, config_options(), ["--config", str(config)])
    league = spec_from_args(GENERIC, args, GENERIC_DEFAULTS).base
    arms = configs("fonts")
    assert league.diagnostic_examples != arms["ce"].diagnostic_examples  # the reason the key must leave it out
    for seed in (0, 9):
        entries = {cache_entry(config.replace(seed=seed), "cache") for config in (league, *arms.values()) if config.init == "base"}
        assert len(entries) == 1, entries


def test_the_like_for_like_errors_and_gradient_norms_reach_the_compact_results_and_the_tables(tmp_path):
    """A study whose epochs measured them: the compact runs keep the last epoch's train-mode error
    and each run's first-step and middle-epoch gradient norms; the report prints both tables."""
    import pandas as pd

    from dpsm_ray.results.studies import Arm, analyse, read_compact

    arms = (Arm("ce", "CE fine-tuned", {"method": "ce"}), Arm("dpsm_t001_l05", "DPSM", {"method": "dpsm"}))
    epochs, evals = [], []
    for stage, q in (("ce", math.nan), ("dpsm_t001_l05", 0.9)):
        for seed in (0, 1):
            for epoch in (1, 2, 3, 4):  # the middle epoch of 4: the 2nd
                if stage == "dpsm_t001_l05" and seed == 1 and epoch <= 3:  # a first try of this seed, failed after 3 epochs
                    epochs.append({"stage": stage, "seed": seed, "epoch": epoch, "trial_id": "failed", "q": 0.5, "q_error_train": 9.0,
                                   "q_error_train_mode": 9.0, "ce_grad_norm": 9.0, "size_grad_norm": 9.0})
                epochs.append({"stage": stage, "seed": seed, "epoch": epoch, "trial_id": f"{stage}-{seed}", "q": q, "q_dataset_train": 0.8, "q_error_train": 0.1 * epoch,
                               "train_set_size_q": 1.5, "val_set_size": 1.2, "q_dataset_train_mode": 0.85,
                               "q_error_train_mode": math.nan if stage == "ce" else 0.01 * epoch + seed,
                               "q_dataset_train_mode_d1": 0.86, "q_error_train_mode_d1": math.nan if stage == "ce" else 0.02 * epoch + seed,
                               "ce_grad_norm": 2.0 * epoch, "size_grad_norm": 0.0 if stage == "ce" else 0.5 * epoch + seed})
            evals += [{"stage": stage, "seed": seed, "trial_id": f"{stage}-{seed}", "score": score, "split": 0, "set_size": 1.0, "coverage": 0.9, "covgap": 1.0,
                       "accuracy": 0.9} for score in ("hps", "aps")]
    pd.DataFrame(epochs).to_parquet(tmp_path / "epochs.parquet")
    pd.DataFrame(evals).to_parquet(tmp_path / "evals.parquet")
    study = Study(name="s", common=TrainConfig(dataset="digits", alpha=0.1, eval_splits=1), arms=arms, seeds=(0, 1))
    analysis = analyse(study, tmp_path)
    _, runs, _, _ = read_compact(tmp_path / "compact")
    dpsm = runs[runs.stage == "dpsm_t001_l05"].set_index("seed")
    assert dpsm.q_error_train_mode.tolist() == pytest.approx([0.04, 1.04])  # the last epoch's
    assert dpsm.q_error_train_mode_d1.tolist() == pytest.approx([0.08, 1.08]) and dpsm.q_dataset_train_mode_d1.tolist() == [0.86, 0.86]
    assert dpsm.size_grad_norm_first.tolist() == pytest.approx([0.5, 1.5]) and dpsm.size_grad_norm_middle.tolist() == pytest.approx([1.0, 2.0])
    assert dpsm.ce_grad_norm_middle.tolist() == [4.0, 4.0]
    assert [g["arm"] for g in analysis["gradients"]] == ["ce", "dpsm_t001_l05"]  # CE's size term: 0, measured
    report = (tmp_path / "fidelity.md").read_text()
    # eval-mode error, train-mode error, both Q_n; then D1's part alone: error (0.08 + 1.08) / 2, its Q_n
    assert "| dpsm_t001_l05 | 0.4000 | 0.5400 | 0.8000 | 0.8500 | 0.5800 | 0.8600 |" in report
    assert "| dpsm_t001_l05 | 2.000 | 1.000 | 0.500 | 4.000 | 1.500 | 0.375 |" in report  # first: CE 2, size 1; middle: CE 4, size 1.5
    assert "| ce | 2.000 | 0.000 | 0.000 |" in report


def test_a_league_s_compact_copy_is_read_as_the_study_s_searched_arms_under_its_criterion(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tests" / "results"))
    try:
        from fabricated import SIZES, fabricate
    finally:
        sys.path.pop(0)
    from dpsm_ray.results.league import write_league_compact
    from dpsm_ray.sweep.study import cli

    folder = write_league_compact(fabricate(tmp_path / "league"))  # CE, CUT, DPSM and the base model, 3 seeds, alpha 0.1
    assert cli("sweeps/round_two.py", "round two", round_two.DATASETS, ["--dataset", "fonts_transfer", "--report-from", str(folder)]) == 0
    report = capsys.readouterr().out
    for arm in ("base", "searched_ce", "searched_cut", "searched_dpsm"):
        assert f"(`{arm}`) | 3 |" in report
    # DPSM's HPS sets per seed 10.01, 10.02, 10.03 against searched CE's 10: +0.2% on average, the best baseline for HPS
    claim = next(line for line in report.splitlines() if line.startswith("**The claim**"))
    assert "**contradicted**" in claim and "HPS: against `searched_ce` +0.2% [" in claim
    assert SIZES["cut"][0] > SIZES["ce"][0]  # CUT's are larger: CE is the best baseline
    # the per-model diagnostics from league-runs.csv: DPSM's q error 0.1 / epoch, 0.0333 at the last of 3, 0.0611 over all
    assert "| searched_dpsm | 0.2000 | 0.2000 | 0.0333 | 0.0611 | 1.00 | 1.10 |" in report
    # a league at another alpha than the study's is refused in one line
    with pytest.raises(SystemExit) as stopped:
        cli("sweeps/round_two.py", "round two", round_two.DATASETS, ["--dataset", "fashion_mnist", "--report-from", str(folder)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().endswith("a league at alpha 0.1; fashion_mnist's study is at alpha 0.01")


def test_fashion_mnist_is_only_read_from_the_league_never_run_by_round_two(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "sweeps" / "round_two.py"), "--dataset", "fashion_mnist"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert "round two reads its searches from the league's results" in run.stderr and not (tmp_path / "results").exists()


def test_a_study_s_own_arms_and_a_league_s_searches_are_read_as_one_study_the_shared_base_model_once(tmp_path, capsys):
    """Round two on fonts: its sharp arms from its own compact results, its searched arms from the league's;
    the base model both hold is the same models (the same rows), counted once -- and refused if its rows differ."""
    import json

    sys.path.insert(0, str(ROOT / "tests" / "results"))
    try:
        from fabricated import fabricate
    finally:
        sys.path.pop(0)
    from dpsm_ray.results.league import write_league_compact
    from dpsm_ray.results.runs import COMPACT_RUNS
    from dpsm_ray.results.studies import read_league_as_study
    from dpsm_ray.sweep.study import cli

    league = write_league_compact(fabricate(tmp_path / "league"))  # CE, CUT, DPSM and the base model, 3 seeds, alpha 0.1
    evals, _, _, _, _ = read_league_as_study(league)
    sharp = evals[evals.stage == "searched_dpsm"].assign(stage="dpsm_t001_l05")
    sharp = sharp.assign(set_size=sharp.set_size * 1.1)  # 10% larger than searched DPSM's, seed by seed
    study = tmp_path / "study"
    study.mkdir()

    def write_study(base_rows) -> None:
        import pandas as pd

        pd.concat([base_rows, sharp]).to_csv(study / "evals.csv", index=False)
        pd.DataFrame(columns=list(COMPACT_RUNS)).to_csv(study / "runs.csv", index=False)
        (study / "arms.json").write_text(json.dumps([
            {"name": "base", "title": "CE base model, not fine-tuned (the paper's CE column)", "settings": {"method": "base", "epochs": 0}},
            {"name": "dpsm_t001_l05", "title": "DPSM, T 0.01, lambda 0.5", "settings": {"method": "dpsm"}},
        ]))

    base = evals[evals.stage == "base"]
    write_study(base)
    argv = ["--dataset", "fonts_transfer", "--report-from", str(study), str(league)]
    assert cli("sweeps/round_two.py", "round two", round_two.DATASETS, argv) == 0
    report = capsys.readouterr().out
    for arm in ("base", "dpsm_t001_l05", "searched_ce", "searched_cut", "searched_dpsm"):
        assert report.count(f"(`{arm}`) | 3 |") == 1, arm  # the base model once, with its 3 models
    # a comparison across the two folders, paired by seed: the sharp arm against searched CE
    row = next(line for line in report.splitlines() if line.startswith("| dpsm_t001_l05 | searched_ce |"))
    searched = evals[(evals.stage == "searched_dpsm") & (evals.score == "hps")].groupby("seed").set_size.mean()
    ce = evals[(evals.stage == "searched_ce") & (evals.score == "hps")].groupby("seed").set_size.mean()
    assert row.split("|")[3].strip().startswith(f"{100 * ((1.1 * searched / ce) - 1).mean():+.1f}% [")

    write_study(base.assign(set_size=base.set_size + 0.01))  # another base model under the same name
    with pytest.raises(SystemExit) as stopped:
        cli("sweeps/round_two.py", "round two", round_two.DATASETS, argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"arm base is in {study} and in {league} with different evaluation rows" in error


def test_one_arm_s_seeds_from_two_studies_are_joined_and_an_overlap_must_be_the_same_models(tmp_path):
    """Round three's two backbones: seeds 0-1 of an arm in one study's folder, seed 2 in another's,
    read as one arm of three seeds; a seed in both with other rows is refused."""
    import json

    import pandas as pd

    from dpsm_ray.results.runs import COMPACT_RUNS
    from dpsm_ray.results.studies import COMPACT_EVALS, read_study_folders

    def folder(name: str, seeds, shift: float = 0.0) -> Path:
        path = tmp_path / name
        path.mkdir()
        rows = [{"stage": "ce", "seed": seed, "score": "hps", "split": split, "set_size": 1.5 + seed / 10 + shift, "coverage": 0.9,
                 "covgap": 1.0, "accuracy": 0.8} for seed in seeds for split in range(2)]
        pd.DataFrame(rows)[list(COMPACT_EVALS)].to_csv(path / "evals.csv", index=False)
        pd.DataFrame(columns=list(COMPACT_RUNS)).to_csv(path / "runs.csv", index=False)
        (path / "arms.json").write_text(json.dumps([{"name": "ce", "title": "CE fine-tuned", "settings": {"method": "ce"}}]))
        return path

    one, two = folder("backbone-0", (0, 1)), folder("backbone-1", (2,))
    evals, _, arms, _, _ = read_study_folders([one, two])
    assert [arm.name for arm in arms] == ["ce"] and sorted(set(evals.seed)) == [0, 1, 2] and len(evals) == 6
    evals, _, _, _, _ = read_study_folders([one, one])  # the same models twice: once
    assert len(evals) == 4
    with pytest.raises(ValueError, match="arm ce is in .*backbone-0 and in .*clash with different evaluation rows"):
        read_study_folders([one, folder("clash", (1, 2), shift=0.1)])
