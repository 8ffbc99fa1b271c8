"""Class-conditional calibration on a small real run: a CE model trained for two epochs on 3000
Fashion-MNIST images (``dpsm-ray train --out``, ~1 minute on 2 cores) and calibrated on the
dataset's 5000-image calibration split, 500 of each class.  Marginal sets cover 90% on average
and leave the hard classes (shirts) far short; class-conditional sets cover every class within its
finite-sample bound.  Needs Debian's dataset-fashion-mnist (skipped without it).

**The bound.** A class y with n calibration points has the threshold q_y, the k-th smallest of
their scores, k = ceil((n + 1)(1 - alpha)) (infinite when k > n: then every set holds y).  Given the
calibration points, a test point of class y is covered with probability F_y(q_y), F_y the
distribution of its score; for a continuous F_y that is the k-th smallest of n uniforms, so it is
Beta(k, n + 1 - k) distributed, with mean k / (n + 1) >= 1 - alpha -- exactly 1 - alpha in
expectation, up to the rounding of k.  The m test points of class y are covered independently
given it, so their count is BetaBinomial(m, k, n + 1 - k): the exact finite-sample distribution of
the class's test coverage, for any model.  Ties between scores only make sets larger, so its
lower tail stays a valid bound.  Each check asks the covered count to reach the delta-quantile of
that distribution, with delta = 0.001 / (number of checks) (Bonferroni): a correct implementation
fails any of them with probability at most 0.001.  For n = 500, m = 500 it is 401 of 500, 0.802
(coverage 0.90 with standard deviation 0.019; 0.836 for one check at 0.001); in the run measured when this test was written, the
marginal sets' worst class (shirts) covered 0.62 (margin) to 0.77 (SAPS) of its 500 test images.
"""

import math
import warnings
from pathlib import Path

import pytest
import torch

from dpsm_ray.cards import load_splits, score_functions, score_names
from dpsm_ray.conformal import Resplits, conformal_rank, evaluate_classes, label_ranks, rc3p_calibration
from dpsm_ray.predict.predictor import Predictor

DEBIAN = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(not (DEBIAN / "train-images-idx3-ubyte.gz").is_file(),
                                reason="needs Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist; .ci/run installs it)")
ALPHA = 0.1
RESPLITS = 3
CHECKS = len(score_names()) * 10 * (1 + RESPLITS)  # scores x classes x (the dataset's split and the evaluation's re-splits)
DELTA = 0.001 / CHECKS


def beta_binomial_lower(m: int, a: int, b: int, delta: float) -> int:
    """The smallest count c with P(X <= c) > delta for X ~ BetaBinomial(m, a, b): a count below it
    has probability at most delta.  pmf(j) = C(m, j) B(j + a, m - j + b) / B(a, b), in logs."""
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    cumulative = 0.0
    for j in range(m + 1):
        log_pmf = (math.lgamma(m + 1) - math.lgamma(j + 1) - math.lgamma(m - j + 1) + math.lgamma(j + a) + math.lgamma(m - j + b)
                   - math.lgamma(m + a + b) - log_beta)
        cumulative += math.exp(log_pmf)
        if cumulative > delta:
            return j
    return m


def lowest_count(n_cal: int, n_test: int) -> int:
    """The fewest of ``n_test`` test points of a class with ``n_cal`` calibration points that its
    class-conditional sets cover but with probability ``DELTA``."""
    k = conformal_rank(n_cal, ALPHA)
    return n_test if k > n_cal else beta_binomial_lower(n_test, k, n_cal + 1 - k, DELTA)


def test_beta_binomial_bound_by_hand():
    # BetaBinomial(1, 1, 1) is uniform on {0, 1}; BetaBinomial(2, 1, 1) uniform on {0, 1, 2}
    assert beta_binomial_lower(1, 1, 1, 0.49) == 0 and beta_binomial_lower(1, 1, 1, 0.51) == 1
    assert beta_binomial_lower(2, 1, 1, 0.34) == 1 and beta_binomial_lower(2, 1, 1, 0.67) == 2
    # n = 9 calibration points at alpha 0.1: k = 9, coverage Beta(9, 1), mean 0.9; a class with 8 has no finite threshold
    assert lowest_count(8, 30) == 30 and 0 < lowest_count(9, 30) < 27
    assert 0.80 < lowest_count(500, 500) / 500 < 0.83  # 0.9 less about 5 standard deviations of 0.019
    k = conformal_rank(500, ALPHA)
    assert beta_binomial_lower(500, k, 501 - k, 0.001) == 418  # one check at 0.001: 0.836 (docs/predictor.md)


@pytest.fixture(scope="module")
def fashion(tmp_path_factory):
    """The run's predictor and the calibration and test splits' probabilities, labels and ids."""
    from dpsm_ray.cli import main

    out = tmp_path_factory.mktemp("fashion") / "run"
    assert main(["train", "--dataset", "fashion_mnist", "--data-root", str(DEBIAN), "--method", "ce", "--init", "scratch", "--epochs", "2",
                 "--train-subset", "3000", "--batch-size", "100", "--eval-splits", "2", "--data-workers", "0", "--out", str(out)]) == 0
    predictor = Predictor.load(out / "predictor", device="cpu")
    data = load_splits("fashion_mnist", str(DEBIAN), seed=0)
    parts = {name: (predictor.predict_proba(part.source.inputs[part.ids]), part.labels, part.ids)
             for name, part in (("cal", data.cal), ("test", data.test))}
    return predictor, parts


def covered_counts(mask: torch.Tensor, labels: torch.Tensor) -> list[int]:
    return [int(mask[labels == label, label].sum()) for label in range(10)]


def test_class_conditional_sets_cover_every_class_within_its_bound_where_marginal_sets_do_not(fashion):
    predictor, parts = fashion
    (cal_probs, cal_labels, cal_ids), (test_probs, test_labels, test_ids) = parts["cal"], parts["test"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 500 points of every class: no class falls back
        calibrated = predictor.calibrated(cal_probs, cal_labels, ALPHA, by="class", example_ids=cal_ids, data="the calibration split")
    n_cal, n_test = torch.bincount(cal_labels).tolist(), torch.bincount(test_labels).tolist()
    bounds = [lowest_count(n, m) for n, m in zip(n_cal, n_test)]
    for score in score_names():
        conditional = calibrated.sets_from_proba(test_probs, score, example_ids=test_ids).mask  # its own: class-conditional
        marginal = calibrated.sets_from_proba(test_probs, score, calibration="marginal", example_ids=test_ids).mask
        counts, marginal_counts = covered_counts(conditional, test_labels), covered_counts(marginal, test_labels)
        assert all(c >= b for c, b in zip(counts, bounds)), (score, counts, bounds)
        assert any(c < b for c, b in zip(marginal_counts, bounds)), (score, marginal_counts, bounds)  # some class left short


def test_the_evaluation_s_class_conditional_rows_are_within_the_bound_on_every_re_split(fashion):
    predictor, parts = fashion
    probs, labels, ids = (torch.cat([parts["cal"][i], parts["test"][i]]) for i in range(3))
    resplits = Resplits(score_functions(), splits=RESPLITS, cal_fraction=0.5, seed=predictor.uniform_seed, example_ids=ids,
                        calibrations=("marginal", "class"))
    rows = evaluate_classes(probs, labels, ALPHA, resplits)
    assert len(rows) == len(score_names()) * 2 * RESPLITS * 10
    short = {score: 0 for score in score_names()}
    for row in rows:
        covered = round(row["coverage"] * row["n_test"])
        if row["calibration"] == "class":
            assert covered >= lowest_count(row["n_cal"], row["n_test"]), row
        else:
            short[row["score"]] += covered < lowest_count(row["n_cal"], row["n_test"])
    assert all(short.values()), short  # every score's marginal sets leave some class short on some re-split


def test_rc3p_and_clustered_predictors_give_their_calibrations_sets_and_keep_them(fashion, tmp_path):
    from dpsm_ray.predict.predictor import PredictorError

    predictor, parts = fashion
    (cal_probs, cal_labels, cal_ids), (test_probs, test_labels, test_ids) = parts["cal"], parts["test"]
    ranked = predictor.calibrated(cal_probs, cal_labels, ALPHA, by="rc3p", example_ids=cal_ids, data="the calibration split")
    ranked.save(tmp_path / "rc3p")
    loaded = Predictor.load(tmp_path / "rc3p", device="cpu")
    assert loaded.calibrated_by == "rc3p" and loaded.info["format_version"] == 3 and "RC3P sets" in repr(loaded)
    for score in ("hps", "aps"):
        scores = loaded.score_matrix(cal_probs, score, cal_ids)
        own = scores[torch.arange(len(cal_labels)), cal_labels]
        expected = rc3p_calibration(own, label_ranks(cal_probs)[torch.arange(len(cal_labels)), cal_labels], cal_labels, 10, ALPHA)
        thresholds, limits = loaded.set_thresholds(score)
        assert torch.equal(limits, expected.rank_limits) and torch.equal(thresholds, expected.thresholds)
        mask = loaded.sets_from_proba(test_probs, score, example_ids=test_ids).mask
        test_scores = loaded.score_matrix(test_probs, score, test_ids)
        assert torch.equal(mask, (test_scores <= thresholds) & (label_ranks(test_probs) <= limits))
        # every class covered near 1 - alpha on its 500 test points (RC3P's class-wise guarantee; 4 standard errors)
        for label in range(10):
            assert mask[test_labels == label, label].double().mean() >= 1 - ALPHA - 4 * (0.09 / 500) ** 0.5, (score, label)
    with pytest.raises(PredictorError, match="p-values are defined for the marginal and class calibrations; rc3p"):
        loaded.p_values_from_proba(test_probs, "hps")
    # ten classes of 500 points: the paper's defaults make 29 clusters of 10 classes, so none: the marginal sets
    clustered = predictor.calibrated(cal_probs, cal_labels, ALPHA, by="cluster", example_ids=cal_ids, data="the calibration split")
    assert clustered.info["scores"]["hps"]["clusters"] == [-1] * 10
    assert torch.equal(clustered.sets_from_proba(test_probs, "hps", example_ids=test_ids).mask,
                       clustered.sets_from_proba(test_probs, "hps", calibration="marginal", example_ids=test_ids).mask)


def test_evaluate_gives_the_metrics_of_evals_parquet(fashion):
    from dpsm_ray.conformal import Resplits, evaluate

    predictor, parts = fashion
    (cal_probs, cal_labels, cal_ids), (test_probs, test_labels, test_ids) = parts["cal"], parts["test"]
    probs, labels, ids = torch.cat([cal_probs, test_probs]), torch.cat([cal_labels, test_labels]), torch.cat([cal_ids, test_ids])
    from dpsm_ray.conformal import resplit

    seed = predictor.uniform_seed  # the evaluation's uniforms are the predictor's
    cal, test = resplit(len(labels), 1, len(cal_labels) / len(labels), seed)
    mine = predictor.calibrated(probs[cal[0]], labels[cal[0]], ALPHA, by="rc3p", example_ids=ids[cal[0]], data="part")
    measured = mine.measure(probs[test[0]], labels[test[0]], example_ids=ids[test[0]])
    resplits = Resplits(score_functions(("hps", "aps")), splits=1, cal_fraction=len(cal_labels) / len(labels), seed=seed,
                        example_ids=ids, calibrations=("rc3p",))
    rows = evaluate(probs, labels, ALPHA, resplits, wsc_directions=4)
    for row in rows:
        ours = measured[row["score"]]
        for name in ("coverage", "set_size", "empty_rate", "singleton_rate", "classes_under", "class_coverage_min", "class_coverage_max",
                     "ece"):
            assert ours[name] == pytest.approx(row[name], abs=1e-12), (row["score"], name)


def test_control_risk_bounds_the_class_weighted_miss_cost_on_held_out_points(fashion, tmp_path):
    """A sandal (class 5) must rarely be missed, a shirt (6) may be often: the miss cost on the test
    split stays under the level, and the predictor keeps its lambda through save and load."""
    from dpsm_ray.conformal import miss_cost
    from dpsm_ray.predict.predictor import PredictorError

    predictor, parts = fashion
    (cal_probs, cal_labels, cal_ids), (test_probs, test_labels, test_ids) = parts["cal"], parts["test"]
    names = predictor.class_names
    costs = {names[5]: 1.0, 6: 0.1, names[0]: 0.5}
    level = 0.02
    controlled = predictor.calibrated_risk(cal_probs, cal_labels, predictor.class_costs(costs), level, ALPHA, example_ids=cal_ids,
                                           data="the calibration split")
    controlled.save(tmp_path / "risk")
    loaded = Predictor.load(tmp_path / "risk", device="cpu")
    assert loaded.calibrated_by == "risk" and loaded.info["risk"]["costs"][5] == 1.0 and loaded.info["risk"]["costs"][1] == 0.0
    weights = torch.tensor(loaded.info["risk"]["costs"], dtype=torch.float64)
    for score in ("hps", "aps"):
        mask = loaded.sets_from_proba(test_probs, score, example_ids=test_ids).mask
        cost = float(miss_cost(mask, test_labels, weights))
        spread = float((~mask[torch.arange(len(test_labels)), test_labels]).double().mul(weights[test_labels]).std()) / len(test_labels) ** 0.5
        assert cost <= level + 3 * spread, (score, cost)
        # classes that cost nothing may be missed far more often than at 1 - alpha: the sets are smaller than marginal ones
        marginal = predictor.calibrated(cal_probs, cal_labels, ALPHA, example_ids=cal_ids, data="x").sets_from_proba(
            test_probs, score, example_ids=test_ids).mask
        assert mask.sum() < marginal.sum()
    with pytest.raises(PredictorError, match="p-values are defined for the marginal and class calibrations; risk"):
        loaded.p_values_from_proba(test_probs, "hps")
    with pytest.raises(ValueError, match="costs: 'boots' is not a class of this predictor"):
        predictor.class_costs({"boots": 1.0})
    with pytest.raises(ValueError, match="control_risk"):
        predictor.calibrated(cal_probs, cal_labels, ALPHA, by="risk", data="x")
