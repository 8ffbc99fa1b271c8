"""The paper-style table from hand-made evaluation rows (no Ray)."""

import pandas as pd

from dpsm_ray.results.report import paper_table


def rows(method, score, sizes):
    return [{"method": method, "score": score, "set_size": size} for size in sizes]


def test_the_table_gives_mean_std_and_dpsms_change_against_the_best_baseline():
    evals = pd.DataFrame(rows("ce", "hps", [2.0, 4.0]) + rows("cut", "hps", [2.5, 2.5]) + rows("dpsm", "hps", [2.0, 2.0]))
    table = paper_table(evals)
    assert table[0] == ["method", "HPS"]
    assert table[1] == ["CE", "3.00 ± 1.41"]  # std with ddof 1: sqrt(2)
    assert table[3] == ["DPSM", "2.00 ± 0.00"]
    assert table[-1] == ["DPSM vs best baseline", "↓ 20.00%"]  # (2.0 - 2.5) / 2.5, CUT being the best baseline


def test_a_score_that_a_baseline_lacks_or_empty_sets_give_no_percentage():
    evals = pd.DataFrame(rows("ce", "hps", [1.0]) + rows("dpsm", "hps", [0.8]) + rows("dpsm", "aps", [1.0]) + rows("ce", "raps", [0.0]) + rows("dpsm", "raps", [0.0]))
    change = paper_table(evals)[-1]
    assert change == ["DPSM vs best baseline", "↓ 20.00%", "n/a", "n/a"]
