import math

import pytest
import torch

from dpsm_ray.cards import score_functions, score_matrix, score_names
from dpsm_ray.conformal import CALIBRATIONS, CLASS_COLUMNS, EVAL_COLUMNS, Resplits, evaluate, evaluate_classes, example_uniforms, resplit


BOTH = ("marginal", "class")  # the calibrations the slow loops below reproduce (conformal/test_classwise.py: the others)
SCORES = score_functions()  # every score, by its card


def calibrated_data(n, k, seed):
    """Softmax outputs with labels drawn from them: exchangeable and continuous (no score ties)."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, k, generator=generator, dtype=torch.float64) * 1.5, dim=1)
    labels = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return probs, labels


def slow_quantile(values, alpha):
    """The ceil((n + 1)(1 - alpha))-th smallest of ``values`` (inf when that exceeds n), by sorting a list."""
    values = sorted(values)
    rank = math.ceil((len(values) + 1) * (1 - alpha) - 1e-12)
    return values[rank - 1] if rank <= len(values) else math.inf


def slow_thresholds(probs, labels, alpha, cal_index, kind, u, calibration):
    """Each class's threshold: the one marginal q, or (class) the quantile of that class's own calibration scores."""
    scores = score_matrix(probs, kind, u=u)
    cal = cal_index.tolist()
    if calibration == "marginal":
        return [slow_quantile([scores[i, labels[i]].item() for i in cal], alpha)] * probs.shape[1]
    return [slow_quantile([scores[i, y].item() for i in cal if labels[i] == y], alpha) for y in range(probs.shape[1])]


def slow_split_metrics(probs, labels, alpha, cal_index, test_index, kind, u, calibration="marginal"):
    scores = score_matrix(probs, kind, u=u)
    q = slow_thresholds(probs, labels, alpha, cal_index, kind, u, calibration)
    hits, sizes = 0, 0
    for i in test_index.tolist():
        members = [y for y in range(probs.shape[1]) if scores[i, y].item() <= q[y]]
        hits += labels[i].item() in members
        sizes += len(members)
    return q, hits / len(test_index), sizes / len(test_index)


def test_evaluate_matches_a_slow_loop_over_splits():
    probs, labels = calibrated_data(120, 6, seed=0)
    rows = evaluate(probs, labels, 0.1, Resplits(SCORES, splits=4, cal_fraction=0.5, seed=9, calibrations=BOTH), wsc_directions=8)
    assert len(rows) == len(score_names()) * 2 * 4 and set(rows[0]) == set(EVAL_COLUMNS)
    assert [(r["score"], r["calibration"]) for r in rows[::4]] == [(s, c) for s in score_names() for c in BOTH]
    cal, test = resplit(120, 4, 0.5, 9)
    u = example_uniforms(9, torch.arange(120))
    for row in rows:
        q, cov, size = slow_split_metrics(probs, labels, 0.1, cal[row["split"]], test[row["split"]], row["score"], u, row["calibration"])
        if row["calibration"] == "marginal":
            assert row["q"] == pytest.approx(q[0])
        else:
            assert math.isnan(row["q"])  # a threshold per class: classes.parquet's
        assert row["coverage"] == pytest.approx(cov)
        assert row["set_size"] == pytest.approx(size)
        assert (row["n_cal"], row["n_test"]) == (60, 60)


def test_class_rows_match_a_slow_loop_and_add_up_to_the_marginal_rows():
    probs, labels = calibrated_data(120, 6, seed=0)
    resplits = Resplits(SCORES, splits=4, cal_fraction=0.5, seed=9, calibrations=BOTH)
    rows, marginal = evaluate_classes(probs, labels, 0.1, resplits), evaluate(probs, labels, 0.1, resplits, wsc_directions=8)
    assert len(rows) == len(score_names()) * 2 * 4 * 6 and set(rows[0]) == set(CLASS_COLUMNS)
    cal, test = resplit(120, 4, 0.5, 9)
    u = example_uniforms(9, torch.arange(120))
    for row in rows:
        # the class's own calibration and test points, through the slow loop
        members = [i for i in test[row["split"]].tolist() if labels[i] == row["label"]]
        assert row["n_test"] == len(members)
        assert row["n_cal"] == sum(labels[i] == row["label"] for i in cal[row["split"]].tolist())
        q = slow_thresholds(probs, labels, 0.1, cal[row["split"]], row["score"], u, row["calibration"])
        assert row["q"] == pytest.approx(q[row["label"]])
        if members:
            _, cov, size = slow_split_metrics(probs, labels, 0.1, cal[row["split"]], torch.tensor(members), row["score"], u,
                                              row["calibration"])
            assert (row["coverage"], row["set_size"]) == (pytest.approx(cov), pytest.approx(size))
        else:
            assert math.isnan(row["coverage"]) and math.isnan(row["set_size"])
    for row in marginal:
        key = (row["score"], row["calibration"], row["split"])
        part = [r for r in rows if (r["score"], r["calibration"], r["split"]) == key and r["n_test"]]
        assert sum(r["n_test"] for r in part) == row["n_test"]
        assert sum(r["coverage"] * r["n_test"] for r in part) / row["n_test"] == pytest.approx(row["coverage"])
        assert sum(r["set_size"] * r["n_test"] for r in part) / row["n_test"] == pytest.approx(row["set_size"])
        assert 100 * sum(abs(r["coverage"] - 0.9) for r in part) / len(part) == pytest.approx(row["covgap"])


def test_mean_coverage_is_valid_and_not_conservative():
    # Over many re-splits of one exchangeable pool, the mean coverage lies in
    # [1 - alpha, 1 - alpha + 1/(m + 1)] (no ties), up to the sampling error of the mean.
    probs, labels = calibrated_data(600, 10, seed=1)
    alpha, m, splits = 0.1, 200, 1500
    resplits = Resplits(SCORES, splits=splits, cal_fraction=m / 600, seed=2)
    rows = evaluate(probs, labels, alpha, resplits, wsc_directions=2)
    for kind in score_names():
        covs = torch.tensor([r["coverage"] for r in rows if r["score"] == kind])
        mean, standard_error = covs.mean().item(), covs.std().item() / splits**0.5
        assert 1 - alpha - 4 * standard_error <= mean <= 1 - alpha + 1 / (m + 1) + 4 * standard_error, kind


def test_class_conditional_coverage_is_valid_in_every_class_where_marginal_is_not():
    # A model that is sure of classes 0-2 and unsure of 3-5: marginal sets over-cover the easy
    # classes and under-cover the hard ones; class-conditional sets cover each class.  Over many
    # re-splits the mean coverage of class y lies in [1 - alpha, 1 - alpha + 1/(n_y + 1)] when its
    # n_y calibration points are fixed (Vovk's Mondrian bound; here n_y varies a little from
    # re-split to re-split, so the upper end is taken at the smallest n_y), up to 4 standard errors.
    generator = torch.Generator().manual_seed(6)
    labels = torch.arange(900) % 6
    logits = torch.randn(900, 6, generator=generator, dtype=torch.float64)
    logits[torch.arange(900), labels] += torch.where(labels < 3, 4.0, 0.5)
    probs, alpha, splits = logits.softmax(dim=1), 0.1, 400
    resplits = Resplits(score_functions(("hps", "aps")), splits=splits, cal_fraction=1 / 3, seed=3, calibrations=BOTH)
    rows = evaluate_classes(probs, labels, alpha, resplits)
    for kind in ("hps", "aps"):
        for calibration in BOTH:
            worst = 1.0
            for label in range(6):
                part = [r for r in rows if (r["score"], r["calibration"], r["label"]) == (kind, calibration, label)]
                covs = torch.tensor([r["coverage"] for r in part])
                mean, standard_error = covs.mean().item(), covs.std().item() / splits**0.5
                fewest = min(r["n_cal"] for r in part)
                if calibration == "class":
                    assert 1 - alpha - 4 * standard_error <= mean <= 1 - alpha + 1 / (fewest + 1) + 4 * standard_error, (kind, label)
                worst = min(worst, mean + 4 * standard_error)
            if calibration == "marginal":
                assert worst < 1 - alpha, kind  # some class is left short


def test_too_few_calibration_points_give_full_sets():
    probs, labels = calibrated_data(50, 4, seed=3)
    with pytest.warns(UserWarning, match=r"needs at least 9 calibration points of a class; classes 0, 1, 2, 3 had fewer"):
        rows = evaluate(probs, labels, 0.1, Resplits(SCORES, splits=3, cal_fraction=0.1, seed=0, calibrations=BOTH),
                        wsc_directions=4)  # m = 5 < 1/alpha
    for row in rows:
        assert math.isinf(row["q"]) if row["calibration"] == "marginal" else math.isnan(row["q"])
        assert row["coverage"] == 1.0 and row["set_size"] == 4.0


def test_a_class_with_too_few_calibration_points_is_in_every_class_conditional_set_and_named():
    # class 3 has 6 points in all, so at most 6 in a calibration part: fewer than alpha = 0.1's 9
    probs, labels = calibrated_data(300, 4, seed=8)
    labels[labels == 3] = 2
    labels[:6] = 3
    resplits = Resplits(score_functions(("hps", "saps")), splits=5, cal_fraction=0.5, seed=4, calibrations=("class",))
    with pytest.warns(UserWarning, match=r"alpha=0.1 needs at least 9 calibration points of a class; class 3 had fewer in some re-split"):
        rows = evaluate_classes(probs, labels, 0.1, resplits)
    for row in rows:
        assert math.isinf(row["q"]) == (row["label"] == 3), row
        if row["label"] == 3 and row["n_test"]:
            assert row["coverage"] == 1.0
    with pytest.warns(UserWarning, match="class 3"):
        found = next(f for f in resplits.calibrated_sets(probs, labels, 0.1) if f.score == "hps")
    assert found.sets[..., 3].all() and not found.sets[..., :3].all()  # every test set of every re-split holds class 3


def test_a_class_absent_from_calibration_is_still_predicted_and_scored():
    probs, labels = calibrated_data(200, 5, seed=4)
    labels[labels == 4] = 3
    labels[0] = 4  # class 4 has a single example: absent from calibration in most re-splits
    rows = evaluate(probs, labels, 0.1, Resplits(SCORES, splits=20, cal_fraction=0.5, seed=1), wsc_directions=4)
    cal, test = resplit(200, 20, 0.5, 1)
    absent = [s for s in range(20) if 0 in test[s].tolist()]
    assert absent, "the seed should put example 0 in some test part"
    for row in rows:
        assert all(math.isfinite(row[c]) for c in ("coverage", "set_size", "covgap", "sscv", "accuracy"))
        assert 0.0 <= row["covgap"] <= 100.0
    hps = [row for row in rows if row["score"] == "hps" and row["calibration"] == "marginal"]
    for split in absent:  # class 4 is in the test part only: CovGap averages over the classes present there
        test_ids = test[split].tolist()
        scores = 1.0 - probs
        cal_scores = sorted(scores[i, labels[i]].item() for i in cal[split].tolist())
        q = cal_scores[math.ceil(101 * 0.9) - 1]  # n = 100 calibration points, alpha = 0.1
        per_class: dict[int, list[bool]] = {}
        for i in test_ids:
            per_class.setdefault(labels[i].item(), []).append(scores[i, labels[i]].item() <= q)
        assert 4 in per_class and 4 not in {labels[i].item() for i in cal[split].tolist()}
        expected = 100 * sum(abs(sum(hits) / len(hits) - 0.9) for hits in per_class.values()) / len(per_class)
        assert hps[split]["covgap"] == pytest.approx(expected, abs=1e-9)
        assert hps[split]["q"] == pytest.approx(q)


def test_bad_arguments_are_named():
    probs, labels = calibrated_data(20, 3, seed=5)
    with pytest.raises(ValueError, match="alpha"):
        evaluate(probs, labels, 1.0, Resplits(SCORES))
    with pytest.raises(ValueError, match="score must be one of"):
        evaluate(probs, labels, 0.1, Resplits(score_functions(("thr",))))
    with pytest.raises(ValueError, match="cal_fraction"):
        evaluate(probs, labels, 0.1, Resplits(SCORES, cal_fraction=1.0))
    with pytest.raises(ValueError, match="empty calibration or test"):
        evaluate(probs, labels, 0.1, Resplits(SCORES, cal_fraction=0.01))
    with pytest.raises(ValueError, match="scores must map each score's name to its function"):
        Resplits(["hps"])
    with pytest.raises(ValueError, match=r"calibrations must be some of marginal, class, cluster, rc3p; got \('mondrian',\)"):
        Resplits(SCORES, calibrations=("mondrian",))
    with pytest.raises(ValueError, match=r"probs must be \[n, K\] and labels \[n\]"):
        evaluate_classes(probs, labels[:-1], 0.1, Resplits(SCORES))


def test_cluster_and_rc3p_rows_are_their_calibrations_on_each_resplit():
    from dpsm_ray.conformal.classwise import clustered_calibration, label_ranks, rc3p_calibration
    from dpsm_ray.seeding import derive_seed

    probs, labels = calibrated_data(900, 5, seed=4)
    resplits = Resplits(score_functions(("hps", "aps")), splits=3, cal_fraction=0.5, seed=2, calibrations=CALIBRATIONS)
    rows = evaluate_classes(probs, labels, 0.1, resplits)
    cal, test = resplit(900, 3, 0.5, 2)
    u = example_uniforms(2, torch.arange(900))
    ranks = label_ranks(probs)
    for kind in ("hps", "aps"):
        scores = score_matrix(probs, kind, u=u)
        label_scores = scores[torch.arange(900), labels]
        for split in range(3):
            c, t = cal[split], test[split]
            clustered = clustered_calibration(label_scores[c], labels[c], 5, 0.1, seed=derive_seed(2, "clusters"))
            ranked = rc3p_calibration(label_scores[c], ranks[c, labels[c]], labels[c], 5, 0.1)
            expected = {
                "cluster": scores[t] <= clustered.thresholds,
                "rc3p": (scores[t] <= ranked.thresholds) & (ranks[t] <= ranked.rank_limits),
            }
            for calibration, sets in expected.items():
                part = [r for r in rows if (r["score"], r["calibration"], r["split"]) == (kind, calibration, split)]
                for row in part:
                    own = labels[t] == row["label"]
                    assert row["coverage"] == pytest.approx(sets[own, row["label"]].double().mean().item())
                    assert row["set_size"] == pytest.approx(sets[own].sum(1).double().mean().item())
                q = clustered.thresholds if calibration == "cluster" else ranked.thresholds
                assert [r["q"] for r in part] == q.tolist()


def test_the_conditional_metrics_match_a_slow_loop():
    probs, labels = calibrated_data(400, 6, seed=5)
    resplits = Resplits(score_functions(("hps", "aps")), splits=2, cal_fraction=0.5, seed=1, calibrations=CALIBRATIONS)
    rows = evaluate(probs, labels, 0.1, resplits, wsc_directions=4)
    by_class = evaluate_classes(probs, labels, 0.1, resplits)
    _, test = resplit(400, 2, 0.5, 1)
    for row in rows:
        part = [r for r in by_class if (r["score"], r["calibration"], r["split"]) == (row["score"], row["calibration"], row["split"])]
        covered = [r["coverage"] for r in part if r["n_test"] > 0]
        assert row["classes_under"] == sum(c < 0.9 for c in covered)
        assert (row["class_coverage_min"], row["class_coverage_max"]) == (min(covered), max(covered))
        # the set sizes, from the class rows' mean set size times their points
        total = sum(r["set_size"] * r["n_test"] for r in part if r["n_test"])
        assert total / row["n_test"] == pytest.approx(row["set_size"])
        # ECE by hand: 15 bins of (0, 1] by the top probability
        points = test[row["split"]].tolist()
        bins = {}
        for i in points:
            top = probs[i].max().item()
            b = min(max(math.ceil(top * 15), 1), 15) - 1
            hit = float(probs[i].argmax().item() == labels[i].item())
            bins.setdefault(b, []).append((hit, top))
        ece = sum(abs(sum(h for h, _ in v) - sum(p for _, p in v)) for v in bins.values()) / len(points)
        assert row["ece"] == pytest.approx(ece, abs=1e-12)
        assert 0 <= row["empty_rate"] <= 1 and 0 <= row["singleton_rate"] <= 1


def test_empty_and_singleton_rates_by_hand():
    from dpsm_ray.conformal.metrics import class_coverage_range, classes_under, empty_rate, singleton_rate, top_label_ece

    sets = torch.tensor([[False, False, False], [True, False, False], [True, True, False], [False, True, False]])
    labels = torch.tensor([0, 0, 1, 1])
    assert empty_rate(sets).item() == 0.25 and singleton_rate(sets).item() == 0.5
    # class 0: covered once of twice (0.5); class 1: twice (1.0); class 2: no point
    assert classes_under(sets, labels, 0.1).item() == 1
    assert [v.item() for v in class_coverage_range(sets, labels)] == [0.5, 1.0]
    # two points at top probability 0.9 (bin 14), one right; one at 0.5 (bin 7), right: (|1 - 1.8| + |1 - 0.5|) / 3
    probs = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.5, 0.5]], dtype=torch.float64)
    assert top_label_ece(probs, torch.tensor([0, 0, 0])).item() == pytest.approx((0.8 + 0.5) / 3)
