"""The tables' cells and the test of a model at chance, by hand."""

import math

import pandas as pd
import pytest

from dpsm_ray.results.tables import CHANCE_MARGIN, cell, chance_warning, format_summary, summarise


def test_a_model_at_most_five_points_above_one_over_k_is_at_chance():
    assert CHANCE_MARGIN == 0.05
    assert chance_warning(0.15, 10) == "test accuracy 0.150, at most 0.05 above chance (1/10 = 0.100)"  # 0.1 + 0.05
    assert chance_warning(0.112, 10) and chance_warning(0.02, 10)  # the resnet18 after 1 epoch; below chance too
    assert chance_warning(0.16, 10) is None
    assert chance_warning(0.55, 2) and chance_warning(0.56, 2) is None


def test_sets_that_hold_every_class_are_at_chance_whatever_the_accuracy():
    assert chance_warning(0.9, 10, set_size=10.0) == "every prediction set holds all 10 classes"
    assert chance_warning(0.9, 10, set_size=9.99) is None


def test_chance_needs_two_classes():
    with pytest.raises(ValueError, match="num_classes must be >= 2; got 1"):
        chance_warning(1.0, 1)


def test_a_cell_leaves_nan_out_and_is_n_a_without_values():
    assert cell(pd.Series([0.8, math.nan, 0.9]), 3) == "0.850 ± 0.071"  # sd of 0.8, 0.9: 0.1 / sqrt(2)
    assert cell(pd.Series([0.8]), 3) == "0.800 ± 0.000"
    assert cell(pd.Series([math.nan, math.nan]), 3) == "n/a"


def test_the_run_summary_prints_a_metric_that_is_nan_everywhere_as_n_a():
    """`dpsm-ray train`'s table: a WSC NaN on every re-split once printed as "nan ± 0.000"."""
    rows = [{"score": "hps", "coverage": 0.9, "set_size": 2.0, "covgap": 1.0, "sscv": 0.1, "wsc": math.nan, "accuracy": 0.5}] * 2
    line = format_summary(summarise(pd.DataFrame(rows))).splitlines()[2]
    assert line.split() == ["hps", "0.900", "±", "0.000", "2.000", "±", "0.000", "1.00", "±", "0.00", "0.100", "±", "0.000", "n/a",
                            "0.500", "±", "0.000"]
