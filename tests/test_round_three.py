"""Round three's arms and verdicts (sweeps/round_three.py, docs/fidelity.md "Round three"): the two
studies the criterion asks for, the order the budget cuts them in, the claim's rule by hand, and the
report that joins the two backbones' seeds."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.results.runs import COMPACT_RUNS
from dpsm_ray.results.studies import COMPACT_EVALS, Arm, Study, analyse_tables, markdown_report
from dpsm_ray.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sweeps"))
try:
    import round_three
finally:
    sys.path.pop(0)

SEARCHED = ("searched_ce", "searched_conftr", "searched_cut", "searched_dpsm")


@pytest.fixture
def round_dir(tmp_path) -> Path:
    """A round's directory past its regime check (10 shots), its backbones not trained."""
    (tmp_path / "regime.json").write_text(json.dumps({"chosen_shots": 10}))
    return tmp_path


def test_two_studies_of_five_seeds_one_per_backbone_on_seed_0_s_split(round_dir):
    definitions = round_three.arm_studies(round_dir, False, trained=False)
    assert list(definitions) == ["backbone-0", "backbone-1"]
    for b, definition in enumerate(definitions.values()):
        common = TrainConfig.from_dict(definition["common"])
        assert (common.seed, common.split_seed, definition["seeds"]) == (5 * b, 0, 5)
        assert common.pretrained_path == str(round_dir / "backbones" / f"seed-{b}" / "model.pt")
        assert common.dataset == "fonts_transfer:classes=79,first=62,shots=10,eval=5,noise=20,backbone_classes=62"
        assert definition["differing"] == ("pretrained_path",) and definition["claim_rule"] == "round_three"
        assert definition["seed_groups"] == ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))
    # the sharp arms at searched CE's lr in the committed search (its trial 8: lr 0.004362)
    sharp = {arm.name: arm.settings for arm in definitions["backbone-1"]["arms"]}
    assert sharp["dpsm_t001_l05"]["lr"] == sharp["cut_l05"]["lr"] == sharp["dpsm_t003_l05"]["lr"] == pytest.approx(0.004362, abs=5e-7)
    assert sharp["dpsm_t001_l05"] == {**sharp["dpsm_t003_l05"], "sigmoid_temperature": 0.01} and sharp["dpsm_t001_l05"]["ce_batch"] == "full"


def test_the_arms_run_references_and_searches_first_then_the_sharp_arms_last_cut_first_last(round_dir):
    phases = round_three.arm_phases(False)
    assert phases[0] == ("base", "ce", *SEARCHED)
    added = [next(iter(set(later) - set(earlier))) for earlier, later in zip(phases, phases[1:])]
    assert added == ["dpsm_t001_l05", "cut_l05", "dpsm_t003_l05"]  # the criterion cuts DPSM at T 0.03 first, so it runs last
    assert all(set(earlier) < set(later) for earlier, later in zip(phases, phases[1:]))  # each call names what ran before it
    assert round_three.arm_phases(True)[0] == ("base", "ce")  # a smoke run has no searched arms


def test_no_shots_in_the_regime_stops_round_three_with_one_line(tmp_path):
    (tmp_path / "regime.json").write_text(json.dumps({"chosen_shots": None}))
    with pytest.raises(SystemExit, match="names no shots in the regime: run --stage regime"):
        round_three.arm_studies(tmp_path, False, trained=False)
    (tmp_path / "regime.json").write_text(json.dumps({"chosen_shots": 10}))
    with pytest.raises(SystemExit, match="no backbone 0 in .*run --stage backbones"):
        round_three.arm_studies(tmp_path, False)


def evals_with(changes: dict[str, tuple[float, ...]], base: float = 2.0) -> pd.DataFrame:
    """10 seeds; ``searched_dpsm``'s per-seed percent change against every baseline arm (HPS and
    APS alike), the baselines all of size ``base`` but searched CE (1% larger): CUT is the best."""
    rows = []
    sizes = {"searched_ce": [base * 1.01] * 10, "searched_conftr": [base * 1.02] * 10, "searched_cut": [base] * 10,
             "searched_dpsm": [base * (1 + c / 100) for c in changes["searched_dpsm"]],
             "dpsm_t001_l05": [base * (1 + c / 100) for c in changes["dpsm_t001_l05"]], "cut_l05": [base] * 10}
    for arm, values in sizes.items():
        for seed, size in enumerate(values):
            rows += [{"stage": arm, "seed": seed, "score": score, "split": split, "set_size": size, "coverage": 0.9, "covgap": 1.0,
                      "accuracy": 0.76} for score in ("hps", "aps") for split in (0, 1)]
    return pd.DataFrame(rows)


def round_three_study() -> Study:
    arms = tuple(Arm(name, name, {"method": name.split("_")[1] if name.startswith("searched") else name.split("_")[0]})
                 for name in (*SEARCHED, "dpsm_t001_l05", "cut_l05"))
    analysis = {k: v for k, v in round_three.ANALYSIS.items()}
    return Study("round_three-test", TrainConfig(dataset="digits", alpha=0.1, eval_splits=2), arms, tuple(range(10)), **analysis)


@pytest.mark.parametrize("dpsm, verdict", [
    # every seed 10% smaller (upper end -10% < -5%), both backbones negative
    ((-10.0,) * 10, "supported"),
    # 30% smaller: beyond half the paper's 50% gain
    ((-30.0,) * 10, "supported, of the paper's size"),
    # 60% smaller on backbone 0, 1% larger on backbone 1: the interval's upper end (-6.4%) is below -5%, but not on each backbone
    ((-60.0,) * 5 + (1.0,) * 5, "inconclusive"),
    # 2% smaller on every seed: the lower end (-2%) above -5%
    ((-2.0,) * 10, "contradicted"),
])
def test_round_three_s_claim_rule_by_hand(dpsm, verdict):
    evals = evals_with({"searched_dpsm": dpsm, "dpsm_t001_l05": (-3.0,) * 10})
    analysis = analyse_tables(round_three_study(), evals, pd.DataFrame(columns=list(COMPACT_RUNS)))
    claim = analysis["verdicts"]["claim"]
    assert claim["verdict"] == verdict and claim["rule"] == "round_three"
    for score in ("hps", "aps"):
        assert claim[score]["against"] == "searched_cut"  # the best searched baseline, per score
        assert claim[score]["within"] == pytest.approx([sum(dpsm[:5]) / 5, sum(dpsm[5:]) / 5])
        assert claim[score]["mean"] == pytest.approx(sum(dpsm) / 10)
        if dpsm[0] == -60.0:
            assert claim[score]["high"] < -5 < 0 < claim[score]["within"][1]
    mechanism = analysis["verdicts"]["mechanism"]
    assert (mechanism["arm"], mechanism["against"], mechanism["verdict"]) == ("dpsm_t001_l05", ["cut_l05"], "holds")
    report = markdown_report(analysis)
    assert f"**{verdict}**" in report and "within each backbone" in report and "smaller than `cut_l05`" in report


def test_the_report_joins_the_two_backbones_seeds_and_prints_the_verdict(tmp_path):
    """``--report-from`` two studies' compact folders (seeds 0-4 and 5-9): one study of 10 seeds."""
    evals = evals_with({"searched_dpsm": (-10.0,) * 10, "dpsm_t001_l05": (-3.0,) * 10})
    arms = [{"name": name, "title": name, "settings": {}} for name in dict.fromkeys(evals.stage)]
    folders = []
    for b, seeds in enumerate(((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))):
        folder = tmp_path / f"backbone-{b}"
        folder.mkdir()
        evals[evals.seed.isin(seeds)][list(COMPACT_EVALS)].to_csv(folder / "evals.csv", index=False)
        pd.DataFrame(columns=list(COMPACT_RUNS)).to_csv(folder / "runs.csv", index=False)
        (folder / "arms.json").write_text(json.dumps(arms))
        folders.append(str(folder))
    printed = subprocess.run([sys.executable, str(ROOT / "sweeps" / "round_three.py"), "--report-from", *folders],
                             capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert "10 training seeds" in printed.stdout and "**supported**" in printed.stdout
    assert "within each backbone -10.0% and -10.0%" in printed.stdout
    # and round three's row of docs/fidelity.md's verdict table per regime (these results have no base model)
    assert ("| small data, classes the backbone never saw (round three) | `fonts_transfer`, 79 unseen classes, 10 shots, 2 backbones | n/a "
            "| 50.0% (Caltech-101) | supported | **supported** | CUT / CUT | -10.0%") in printed.stdout
    alone = subprocess.run([sys.executable, str(ROOT / "sweeps" / "round_three.py"), "--report-from", folders[0]],
                           capture_output=True, text=True, timeout=300)
    # one backbone's seeds alone: backbone 1's mean change is missing, so the claim is not supported
    assert alone.returncode == 0 and "5 training seeds" in alone.stdout and "**supported**" not in alone.stdout
    assert "10 shots, 1 backbone |" in alone.stdout


def test_the_verdict_table_per_regime_quotes_round_three_s_row_as_its_report_prints_it():
    """docs/fidelity.md's verdict table holds round three's row as the generated block of its section
    has it (test_decisive checks that block against `--report-from` on the committed results)."""
    doc = (ROOT / "docs" / "fidelity.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| small data, classes the backbone never saw (round three) |")]
    assert len(rows) == 2 and rows[0] == rows[1]
