"""The league's table and verdicts (dpsm_ray/results/league.py, docs/league.md's criterion) by hand, its
compact copy regenerating the same text, and the section a sweep's report gains."""

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.results.league import (
    analyse_league,
    league_markdown,
    league_section,
    read_league_compact,
    verdict,
)
from dpsm_ray.results.provenance import COMPACT_SEARCH
from dpsm_ray.results.stats import t_interval

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2)


def evals(sizes: dict, coverage: dict | None = None) -> pd.DataFrame:
    """Per method, each seed's HPS set size (APS: the same x 1.1; RAPS as APS), on two re-splits that agree."""
    rows = []
    for method, per_seed in sizes.items():
        for seed, size in zip(SEEDS, per_seed):
            for score, factor in (("hps", 1.0), ("aps", 1.1), ("raps", 1.1)):
                for split in (0, 1):
                    rows.append({"method": method, "seed": seed, "score": score, "split": split, "set_size": size * factor,
                                 "coverage": (coverage or {}).get(method, 0.9), "accuracy": 0.8})
    return pd.DataFrame(rows)


SIZES = {
    "ce": (2.0, 2.2, 2.1),
    "dpsm": (1.8, 2.0, 1.9),  # ~-9.5% every seed: beats CE
    "cut": (1.97, 2.23, 2.07),  # -1.5%, +1.4%, -1.4%: ties
    "conftr": (2.4, 2.6, 2.5),  # worse
    "base": (2.5, 2.6, 2.55),
}


def test_each_method_s_change_against_ce_is_its_per_seed_mean_with_a_t_interval_by_hand():
    analysis = analyse_league(evals(SIZES), None, 0.1, "hand")
    dpsm = next(row for row in analysis["ranked"] if row["method"] == "dpsm")
    per_seed = [100 * (d - c) / c for d, c in zip(SIZES["dpsm"], SIZES["ce"])]
    mean, low, high = t_interval(per_seed)
    assert math.isclose(dpsm["changes"]["hps"]["mean"], mean) and math.isclose(dpsm["changes"]["hps"]["low"], low)
    assert math.isclose(dpsm["changes"]["aps"]["high"], high)  # APS is HPS x 1.1 for both: the same relative change
    assert [row["method"] for row in analysis["ranked"]] == ["dpsm", "cut", "ce", "conftr"]  # by HPS set size, base not ranked
    assert {row["method"]: row.get("verdict") for row in analysis["ranked"]} == {
        "dpsm": "beats CE, by a margin that matters", "cut": "ties CE at this resolution", "ce": None, "conftr": "worse than CE"}
    assert analysis["answer"].startswith("DPSM (the smallest HPS sets among the methods that beat CE)")
    assert analysis["base"]["models"] == 3 and "changes" not in analysis["base"]


def test_the_verdict_rule():
    def change(low, high):
        return {"mean": (low + high) / 2, "low": low, "high": high, "detectable": 1.0}

    both = lambda low, high: {"hps": change(low, high), "aps": change(low, high)}
    assert verdict(both(-9, -6), 0.9, 0.1) == "beats CE, by a margin that matters"
    assert verdict(both(-6, -1), 0.9, 0.1) == "beats CE"
    assert verdict({"hps": change(-9, -6), "aps": change(-3, 1)}, 0.9, 0.1) == "ties CE at this resolution"  # both scores must agree
    assert verdict({"hps": change(-9, -6), "aps": change(0.5, 2)}, 0.9, 0.1) == "worse than CE"
    assert verdict(both(-9, -6), 0.89, 0.1).startswith("coverage 0.8900 outside 0.9 +- 0.005")  # the precondition first
    assert verdict({"hps": change(math.nan, math.nan), "aps": change(-9, -6)}, 0.9, 0.1) == "no interval (fewer than two seeds)"


def test_no_method_beating_ce_answers_ce_and_low_coverage_does_not_count():
    analysis = analyse_league(evals({"ce": SIZES["ce"], "dpsm": SIZES["dpsm"], "cut": SIZES["cut"]}, coverage={"dpsm": 0.85}), None, 0.1, "d")
    assert {row["method"]: row.get("verdict", "") for row in analysis["ranked"]}["dpsm"].startswith("coverage 0.8500 outside")
    assert analysis["answer"] == "CE fine-tuned, tuned as carefully, is as good as any of them here"


def test_a_league_without_ce_ranks_its_methods_and_answers_nothing_about_ce():
    """A league run without CE (its CE searched in another league, joined by --ce-from): no verdict
    against a CE it never trained, and no answer that CE is as good as any."""
    analysis = analyse_league(evals({"dpsm": SIZES["dpsm"], "cut": SIZES["cut"]}), None, 0.1, "d")
    assert [row.get("verdict") for row in analysis["ranked"]] == [None, None]
    assert analysis["answer"].startswith("none here: these results hold no CE")


def test_the_compact_copy_regenerates_the_same_table(tmp_path):
    from fabricated import fabricate

    from dpsm_ray.results.league import write_league_compact
    from dpsm_ray.storage.layout import Results

    results = fabricate(tmp_path / "r")  # CE, CUT and DPSM re-trained with 3 seeds, and the base model
    folder = write_league_compact(results)
    regenerated = league_markdown(analyse_league(*read_league_compact(folder)))
    reader = Results(results)
    direct = league_markdown(analyse_league(reader.final("evals"), reader.final("trials").iloc[:0], 0.1, "digits"))
    # the same table, then the searches, which only the compact copy's record holds
    table, searches = regenerated.split("\n\nThe searches (every trial in league-search.csv)")
    assert table + "\n" == direct and "| CE base model (not fine-tuned; not ranked) | 3 |" in regenerated
    # each method's first trial is its pick, both feasible; by HPS set size as the league: CE, DPSM, CUT
    assert json.loads((folder / "league.json").read_text())["picks"] == {"ce": 1, "cut": 1, "dpsm": 1}
    assert searches.splitlines()[-3:] == [
        "| CE | 2 | 2 | 0 | 0 | 0 | trial 1 (size 1.000, coverage 0.9000) | lr 0.02 |",
        "| DPSM | 2 | 2 | 0 | 0 | 0 | trial 1 (size 1.000, coverage 0.9000) | conformal_weight 3.24, lr 0.01, quantile_lr 0.005, sigmoid_temperature 0.5 |",
        "| CUT | 2 | 2 | 0 | 0 | 0 | trial 1 (size 1.000, coverage 0.9000) | conformal_weight 0.2, lr 0.03 |",
    ]
    section = league_section(reader.final("evals"), reader.trials, 0.1, reader.sweep)
    assert section[0] == "## The league" and section[2] == direct.rstrip()
    assert league_section(reader.final("evals")[reader.final("evals").method.isin(["ce", "dpsm"])], reader.trials, 0.1, None) == []
    with pytest.raises(FileNotFoundError, match="league-evals.csv is missing"):
        read_league_compact(tmp_path)
    # every search trial, with the values its method searched: CE 2 (lr), CUT and DPSM 2 each, counted from 1
    search = pd.read_csv(folder / "league-search.csv")
    trials = reader.trials[reader.trials.stage == "search"]
    assert len(search) == len(trials) == 6 and list(search.columns[:7]) == list(COMPACT_SEARCH) and search.columns[-1] == "error"
    assert search.groupby("method").trial.apply(list).to_dict() == {"ce": [1, 2], "cut": [1, 2], "dpsm": [1, 2]}
    assert search[search.method == "ce"][["conformal_weight", "sigmoid_temperature"]].isna().all().all()  # CE searched lr alone
    for row in search.itertuples():
        ran = json.loads(trials[(trials.method == row.method) & (trials.trial_index == row.trial - 1)].config_json.iloc[0])
        assert row.lr == ran["lr"] and row.status == "ok" and row.feasible
    (folder / "league-search.csv").unlink()  # a copy without the record: the table alone
    assert league_markdown(analyse_league(*read_league_compact(folder))) == direct


def test_the_league_ranks_marginal_sets_when_the_sweep_also_calibrated_by_class(tmp_path):
    from fabricated import fabricate

    from dpsm_ray.results.league import write_league_compact
    from dpsm_ray.storage.layout import Results

    plain, both = fabricate(tmp_path / "plain"), fabricate(tmp_path / "both", class_conditional=True)
    assert (Results(both).final("evals").calibration == "class").any()
    tables = [read_league_compact(write_league_compact(results))[0] for results in (plain, both)]
    pd.testing.assert_frame_equal(tables[0], tables[1])  # the class-conditional rows (sets 1.5x larger) left out


def test_a_study_with_searched_arms_keeps_its_search_s_record_beside_its_compact_results(tmp_path):
    from fabricated import fabricate

    from dpsm_ray.storage.layout import Results
    from dpsm_ray.results.provenance import COMPACT_SEARCH
    from dpsm_ray.sweep.study import keep_search_record

    sweep = fabricate(tmp_path / "search")  # CE, CUT and DPSM, 2 search trials each
    keep_search_record(None, tmp_path / "study")
    assert not (tmp_path / "study").exists()  # no --searched-from: nothing to keep
    keep_search_record(str(sweep), tmp_path / "study")
    record = pd.read_csv(tmp_path / "study" / "compact" / "search.csv")
    trials = Results(sweep).trials
    assert len(record) == (trials.stage == "search").sum() == 6 and list(record.columns[: len(COMPACT_SEARCH)]) == list(COMPACT_SEARCH)
    assert sorted(zip(record.method, record.trial)) == [(m, t) for m in ("ce", "cut", "dpsm") for t in (1, 2)]


# docs/league.md quotes each committed league's table between these lines, as the command prints it
GENERATED = re.compile(r"<!-- generated by: (?P<command>python sweeps/league\.py --report-from (?P<folder>\S+)(?P<others>(?: --ce-from \S+)*)) -->\n"
                       r"(?P<text>.*?)"
                       r"<!-- end of generated -->\n", re.S)


def test_docs_league_tables_are_what_the_committed_results_regenerate():
    """Every league table in docs/league.md is exactly what its command prints from the compact rows
    committed under docs/results/, and every committed league is quoted."""
    doc = (ROOT / "docs" / "league.md").read_text()
    blocks = list(GENERATED.finditer(doc))
    committed = sorted(path.parent.name for path in (ROOT / "docs" / "results").glob("league-*/league-evals.csv"))
    quoted = {Path(folder).name for block in blocks for folder in [block["folder"], *block["others"].split()[1::2]]}
    assert committed and set(committed) <= quoted  # a league that searched CE again is quoted by its --ce-from
    for block in blocks:
        printed = subprocess.run([sys.executable, *shlex.split(block["command"])[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0, printed.stderr[-2000:]
        assert block["text"] == printed.stdout, f"docs/league.md's block differs from `{block['command']}`: regenerate it"


def test_a_league_method_against_another_study_s_ce_is_paired_on_the_seeds_whose_base_models_both_share():
    """The Fashion-MNIST league against the decisive test's 8-trial CE: seed 0's base models differ, seeds 1-9's are
    the same model (equal rows); DPSM's HPS change is the per-seed mean of its set size against that CE's, by hand."""
    import pandas as pd
    from scipy import stats

    from dpsm_ray.results.league import against_other_ce, read_league_compact
    from dpsm_ray.results.studies import read_compact

    evals, _, alpha, _, _ = read_league_compact(ROOT / "docs" / "results" / "league-fashion_mnist")
    study = read_compact(ROOT / "docs" / "results" / "decisive-fashion_mnist")[0]
    comparison = against_other_ce(evals, study, alpha)
    assert comparison["seeds"] == list(range(1, 10))
    dpsm = evals[(evals.method == "dpsm") & (evals.score == "hps")].groupby("seed").set_size.mean()
    ce = study[(study.stage == "searched_ce") & (study.score == "hps")].groupby("seed").set_size.mean()
    change = [100 * (dpsm[s] - ce[s]) / ce[s] for s in range(1, 10)]
    mean, half = sum(change) / 9, stats.t.ppf(0.975, 8) * pd.Series(change).std() / 3
    found = next(row for row in comparison["rows"] if row["method"] == "dpsm")["changes"]["hps"]
    assert found["mean"] == pytest.approx(mean) and found["low"] == pytest.approx(mean - half) and found["high"] == pytest.approx(mean + half)
    with pytest.raises(ValueError, match="shares no CE base model"):
        against_other_ce(evals, study.assign(set_size=study.set_size + 1), alpha)


def test_a_league_with_ce_searched_again_takes_ce_s_rows_from_the_other_league_on_the_seeds_whose_base_models_both_share():
    """The committed Fashion-MNIST league against a copy whose CE rows are 10% larger and whose seed-0 base model
    differs: the merged rows hold the copy's CE, its pick and search, on seeds 1-9; DPSM's HPS change against it by hand."""
    import pandas as pd
    from scipy import stats

    from dpsm_ray.results.league import analyse_league, read_league_compact, with_other_ce

    compact = read_league_compact(ROOT / "docs" / "results" / "league-fashion_mnist")
    evals, failed, alpha, dataset, (record, picks) = compact
    ce = evals.method == "ce"
    other_evals = evals.assign(set_size=evals.set_size.where(~ce, evals.set_size * 1.1))
    other_evals.loc[(other_evals.method == "base") & (other_evals.seed == 0), "set_size"] += 1  # another seed-0 base model
    other_record = record.assign(trial=record.trial + 100)
    other = (other_evals, failed, alpha, dataset, (other_record, {**picks, "ce": 107}))
    (merged, merged_failed, _, _, (merged_record, merged_picks)), shared = with_other_ce(compact, other)
    assert shared == list(range(1, 10)) and sorted(merged.seed.unique()) == shared
    assert merged[merged.method == "ce"].set_size.tolist() == other_evals[ce & (other_evals.seed > 0)].set_size.tolist()
    assert merged[merged.method == "dpsm"].set_size.tolist() == evals[(evals.method == "dpsm") & (evals.seed > 0)].set_size.tolist()
    assert merged_picks["ce"] == 107 and merged_picks["dpsm"] == picks["dpsm"]
    assert (merged_record[merged_record.method == "ce"].trial > 100).all() and (merged_record[merged_record.method != "ce"].trial < 100).all()
    analysis = analyse_league(merged, merged_failed, alpha, dataset, (merged_record, merged_picks))
    dpsm = merged[(merged.method == "dpsm") & (merged.score == "hps")].groupby("seed").set_size.mean()
    reference = merged[(merged.method == "ce") & (merged.score == "hps")].groupby("seed").set_size.mean()
    change = [100 * (dpsm[s] - reference[s]) / reference[s] for s in shared]
    mean, half = sum(change) / 9, stats.t.ppf(0.975, 8) * pd.Series(change).std() / 3
    found = next(row for row in analysis["ranked"] if row["method"] == "dpsm")["changes"]["hps"]
    assert found["mean"] == pytest.approx(mean) and found["low"] == pytest.approx(mean - half)
    assert all(row["models"] == 9 for row in analysis["ranked"])
    with pytest.raises(ValueError, match="shares no CE base model"):
        with_other_ce(compact, (other_evals.assign(set_size=other_evals.set_size + 1), failed, alpha, dataset, None))
    with pytest.raises(ValueError, match="ran fonts"):
        with_other_ce(compact, (other_evals, failed, alpha, "fonts", None))


def test_an_unpaired_change_by_hand_and_the_league_against_a_ce_of_other_base_models():
    """The change of two means whose replicates share nothing: the log ratio, the delta method's
    variance and Welch's degrees of freedom, computed here with numpy and scipy.stats; then each
    league method against the CE of a league whose base models are not these (the committed CE
    re-search on Fashion-MNIST)."""
    import numpy as np
    from scipy import stats

    from dpsm_ray.results.league import against_unpaired_ce, read_league_compact
    from dpsm_ray.results.stats import unpaired_change

    a, b = np.array([1.70, 1.75, 1.80, 1.72]), np.array([2.00, 1.90, 1.95, 2.10, 1.98])
    va, vb = a.var(ddof=1) / (len(a) * a.mean() ** 2), b.var(ddof=1) / (len(b) * b.mean() ** 2)
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 4)
    half = stats.t.ppf(0.975, df) * np.sqrt(va + vb)
    found = unpaired_change(a.tolist(), b.tolist())
    assert found["mean"] == pytest.approx(100 * (a.mean() / b.mean() - 1))
    assert found["low"] == pytest.approx(100 * (np.exp(np.log(a.mean() / b.mean()) - half) - 1))
    assert found["high"] == pytest.approx(100 * (np.exp(np.log(a.mean() / b.mean()) + half) - 1))
    assert np.isnan(unpaired_change([1.0], b.tolist())["low"])

    evals, _, alpha, _, _ = read_league_compact(ROOT / "docs" / "results" / "league-fashion_mnist")
    other = read_league_compact(ROOT / "docs" / "results" / "league-fashion_mnist-ce8")[0]
    comparison = against_unpaired_ce(evals, other, alpha)
    assert comparison["seeds"] == (10, 10)
    dpsm = next(row for row in comparison["rows"] if row["method"] == "dpsm")
    mine = evals[(evals.method == "dpsm") & (evals.score == "hps")].groupby("seed").set_size.mean()
    theirs = other[(other.method == "ce") & (other.score == "hps")].groupby("seed").set_size.mean()
    assert dpsm["changes"]["hps"] == unpaired_change(mine.tolist(), theirs.tolist())
    assert [row["size"]["hps"] for row in comparison["rows"]] == sorted(row["size"]["hps"] for row in comparison["rows"])
