"""``Predictor``: the sets against hand computations, recalibration, the files, and what loading refuses.

One digits model is trained per module (``dpsm-ray train --out``, 2 epochs, ~5 s); the sweep's
predictors and the round trip against evals.parquet are in test_predictor_sweep.py.
"""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsm_ray.cli import main
from dpsm_ray.conformal import CALIBRATIONS, Resplits, check_alpha, evaluate, example_uniforms
from dpsm_ray.cards import build_model, load_splits, score_functions, score_names
from dpsm_ray.data.preprocessing import InputSpec
from dpsm_ray.files import read_checked_json, sha256_file, write_checked_json
from dpsm_ray.predict.predictor import INFO_FILE, FORMAT_VERSION, PREDICT_BATCH, WEIGHTS_FILE, InputError, Predictor, PredictorError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``dpsm-ray train --out``: the run directory and its predictor."""
    out = tmp_path_factory.mktemp("run") / "dpsm"
    assert main(["train", "--dataset", "digits", "--method", "dpsm", "--epochs", "2", "--eval-splits", "3", "--seed", "1", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def digits():
    data = load_splits("digits", seed=1)
    raw = {name: getattr(data, name).source.inputs[getattr(data, name).ids] for name in ("cal", "test")}
    return data, raw


def toy_predictor(alpha=0.2) -> Predictor:
    """Three classes over two features; the model does not matter to the tests that use it."""
    spec = InputSpec((2,), 1.0, 0.0, 1.0, "two features")
    return Predictor.create(build_model("mlp", 3, input_shape=(2,)), architecture="mlp", input_spec=spec, num_classes=3, alpha=alpha, device="cpu")


# ----------------------------------------------------------------------------- the sets, by hand


def test_hps_threshold_and_sets_are_split_conformal_by_hand():
    # 9 calibration points whose true-label probabilities are 0.9, 0.8, ..., 0.1: HPS scores 0.1 .. 0.9
    p_true = torch.arange(9, 0, -1, dtype=torch.float64) / 10
    labels = torch.arange(9) % 3
    probs = torch.full((9, 3), 0.0, dtype=torch.float64)
    probs[torch.arange(9), labels] = p_true
    probs[torch.arange(9), (labels + 1) % 3] = 1 - p_true
    # alpha 0.2: q is the ceil(10 * 0.8) = 8th smallest score, 0.8
    predictor = toy_predictor(0.2).calibrated(probs, labels, 0.2, data="nine points")
    assert predictor.thresholds["hps"] == pytest.approx(0.8, abs=1e-12)
    assert predictor.info["scores"]["hps"]["calibration_points"] == 9
    # scores of a new input 1 - p = 0.75, 0.30, 0.95: the set is {0, 1}
    mask, lists = predictor.sets_from_proba(torch.tensor([[0.25, 0.70, 0.05]], dtype=torch.float64), "hps")
    assert lists == [[0, 1]] and mask.tolist() == [[True, True, False]]


def test_non_empty_sets_add_the_top_class_to_empty_sets_only_by_hand():
    # the HPS threshold 0.8 of the test above: 1 - p <= 0.8 needs p >= 0.2
    p_true = torch.arange(9, 0, -1, dtype=torch.float64) / 10
    labels = torch.arange(9) % 3
    probs = torch.zeros(9, 3, dtype=torch.float64)
    probs[torch.arange(9), labels] = p_true
    probs[torch.arange(9), (labels + 1) % 3] = 1 - p_true
    predictor = toy_predictor(0.2).calibrated(probs, labels, 0.2, data="nine points")
    new = torch.tensor([[0.19, 0.18, 0.63], [0.15, 0.05, 0.80], [0.40, 0.35, 0.25]], dtype=torch.float64)
    # 1 - p <= 0.8: only 0.63 in the first, only 0.80 in the second, all three in the third
    assert predictor.sets_from_proba(new, "hps").lists == [[2], [2], [0, 1, 2]]
    sparse = torch.tensor([[0.19, 0.18, 0.17]], dtype=torch.float64)  # every p < 0.2 (a model output need not sum to 1 here)
    plain = predictor.sets_from_proba(sparse, "hps")
    assert plain.lists == [[]] and not plain.mask.any()  # empty: no class within the threshold
    filled = predictor.sets_from_proba(sparse, "hps", non_empty=True)
    assert filled.lists == [[0]] and filled.mask.tolist() == [[True, False, False]]  # the top class alone
    both = torch.cat([new, sparse])
    assert predictor.sets_from_proba(both, "hps", non_empty=True).lists == [[2], [2], [0, 1, 2], [0]]  # non-empty sets unchanged


def test_aps_sets_use_each_input_s_own_uniform_by_hand():
    predictor = toy_predictor(0.2)
    probs = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    u = float(example_uniforms(predictor.uniform_seed, torch.tensor([7]))[0])
    scores = predictor.score_matrix(probs, "aps", example_ids=[7])
    # APS: the mass ranked above the class plus U times its own probability
    assert scores.tolist()[0] == pytest.approx([u * 0.5, 0.5 + u * 0.3, 0.8 + u * 0.2])
    # RAPS adds 0.01 per rank beyond 5: nothing with three classes
    assert torch.equal(predictor.score_matrix(probs, "raps", example_ids=[7]), scores)


def test_sets_equal_the_evaluation_s_on_the_same_split(trained, digits):
    """The predictor calibrated on a calibration part gives the coverage and size ``evaluate``
    computes for that part, uniforms included (one re-split, cal first)."""
    data, raw = digits
    predictor = Predictor.load(trained / "predictor")
    x = torch.cat([raw["cal"], raw["test"]])
    y, ids = torch.cat([data.cal.labels, data.test.labels]), torch.cat([data.cal.ids, data.test.ids])
    probs = predictor.predict_proba(x)
    resplits = Resplits(score_functions(), splits=2, cal_fraction=len(data.cal) / len(x), seed=predictor.uniform_seed, example_ids=ids,
                        calibrations=CALIBRATIONS)
    rows = evaluate(probs, y, 0.1, resplits)
    from dpsm_ray.conformal import resplit

    cal, test = resplit(len(x), 2, len(data.cal) / len(x), predictor.uniform_seed)
    assert {(row["score"], row["calibration"]) for row in rows} == {(s, c) for s in score_names() for c in CALIBRATIONS}
    for row in rows:
        mine = predictor.recalibrate(x[cal[row["split"]]], y[cal[row["split"]]], example_ids=ids[cal[row["split"]]])
        measured = mine.evaluate(x[test[row["split"]]], y[test[row["split"]]], calibration=row["calibration"],
                                 example_ids=ids[test[row["split"]]])[row["score"]]
        assert measured["coverage"] == pytest.approx(row["coverage"], abs=1e-12)
        assert measured["set_size"] == pytest.approx(row["set_size"], abs=1e-12)
        if row["calibration"] == "marginal":
            assert mine.thresholds[row["score"]] == pytest.approx(row["q"], abs=1e-12)


def test_the_predictor_forwards_in_the_evaluation_s_chunks():
    from dpsm_ray.train.loop import EVAL_BATCH

    assert PREDICT_BATCH == EVAL_BATCH


# ----------------------------------------------------------------------------- train --out and the info


def test_train_out_writes_a_predictor_and_says_so(trained, capsys):
    info = read_checked_json(trained / "predictor" / INFO_FILE)
    config = json.loads((trained / "config.json").read_text())
    assert info["run_id"] == config["run_id"] and info["method"] == "dpsm" and info["seed"] == 1
    assert info["model"] == {"architecture": "mlp", "num_classes": 10, "precision": "fp32"}  # never "auto"
    assert info["input"]["shape"] == [1, 8, 8] and info["input"]["divisor"] == 16.0 and info["class_names"] == list("0123456789")
    assert info["training_config"]["epochs"] == 2 and info["alpha"] == 0.1
    assert set(info["scores"]) == set(score_names()) and info["scores"]["raps"]["lambda"] == 0.01 and info["scores"]["raps"]["k_reg"] == 5
    assert info["scores"]["saps"]["lambda"] == 0.2 and info["calibration"]["by"] == "marginal" and info["format_version"] == 1
    assert all(entry["calibration_points"] == 200 for entry in info["scores"].values())  # the digits calibration split
    assert info["test"]["points"] == 297 and 0.5 < info["test"]["scores"]["hps"]["coverage"] <= 1
    assert info["calibration"]["data"].startswith("the calibration split of digits (200 points")


def test_train_without_out_says_nothing_is_saved(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dataset", "digits", "--method", "ce", "--epochs", "1", "--eval-splits", "2"]) == 0
    assert "nothing was saved: pass --out DIR" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_save_and_load_round_trip(trained, digits, tmp_path):
    _, raw = digits
    predictor = Predictor.load(trained / "predictor")
    again = Predictor.load(predictor.save(tmp_path / "copy"))
    assert again.info == read_checked_json(tmp_path / "copy" / INFO_FILE) and again.thresholds == predictor.thresholds
    for score in score_names():
        for calibration in ("marginal", "class"):
            assert torch.equal(again.predict_sets(raw["test"], score, calibration=calibration).mask,
                               predictor.predict_sets(raw["test"], score, calibration=calibration).mask)
        assert torch.equal(again.p_values(raw["test"], score), predictor.p_values(raw["test"], score))
    assert "Predictor(mlp, 10 classes, alpha=0.1, hps q=" in repr(again)
    # a predictor already there is replaced only when asked
    with pytest.raises(PredictorError, match=r"copy holds a predictor already; remove it, choose another directory, or save\(..., overwrite=True\)"):
        predictor.save(tmp_path / "copy")
    assert Predictor.load(predictor.save(tmp_path / "copy", overwrite=True)).info == again.info


def test_numpy_inputs_give_a_numpy_mask(trained, digits):
    _, raw = digits
    predictor = Predictor.load(trained / "predictor")
    from_numpy, from_torch = predictor.predict_sets(raw["test"].numpy()), predictor.predict_sets(raw["test"])
    assert isinstance(from_numpy.mask, np.ndarray) and from_numpy.mask.dtype == bool and isinstance(from_torch.mask, torch.Tensor)
    assert np.array_equal(from_numpy.mask, from_torch.mask.numpy()) and from_numpy.lists == from_torch.lists


def test_flat_numpy_features_give_the_same_sets_and_an_input_s_set_does_not_depend_on_its_chunk(trained, digits):
    _, raw = digits
    predictor = Predictor.load(trained / "predictor")
    ids = torch.arange(1000, 1000 + len(raw["test"]))
    whole = predictor.predict_sets(raw["test"], "aps", example_ids=ids)
    flat = predictor.predict_sets(raw["test"].reshape(-1, 64).numpy(), "aps", example_ids=ids)
    assert np.array_equal(whole.mask.numpy(), flat.mask) and whole.lists == flat.lists
    # greyscale images without their channel axis, as scikit-learn's load_digits().images: [n, 8, 8]
    images = predictor.predict_sets(raw["test"].reshape(-1, 8, 8).numpy(), "aps", example_ids=ids)
    assert np.array_equal(whole.mask.numpy(), images.mask)
    assert whole.lists == [row.nonzero().flatten().tolist() for row in whole.mask]
    # chunks of 7 give the same probabilities as one forward of each chunk on its own: the uniforms
    # come from the ids, not from positions within a chunk
    chunked = predictor.predict_sets(raw["test"], "aps", example_ids=ids, batch_size=7)
    probs = torch.cat([predictor.predict_proba(part) for part in raw["test"].split(7)])
    assert chunked.lists == predictor.sets_from_proba(probs, "aps", example_ids=ids).lists


# ----------------------------------------------------------------------------- recalibration


def test_recalibrate_is_the_exact_quantile_of_the_user_s_points(trained, digits):
    data, raw = digits
    predictor = Predictor.load(trained / "predictor")
    mine = predictor.recalibrate(raw["test"][:100], data.test.labels[:100], alpha=0.2)
    hps = 1 - predictor.predict_proba(raw["test"][:100]).gather(1, data.test.labels[:100, None]).squeeze(1)
    # rank ceil(101 * 0.8) = 81 of 100, written out with a sort
    assert mine.thresholds["hps"] == hps.sort().values[80].item()
    assert mine.alpha == 0.2
    top1 = predictor.predict_proba(raw["test"][:100]).argmax(dim=1)
    assert mine.info["calibration"] == {"data": "100 points passed to Predictor.recalibrate", "points": 100, "by": "marginal",
                                        "accuracy": (top1 == data.test.labels[:100]).double().mean().item()}
    assert mine.info["test"] is None and predictor.alpha == 0.1  # the original is unchanged


def test_recalibration_follows_the_conformal_core_on_alpha_and_small_samples(trained, digits):
    data, raw = digits
    predictor = Predictor.load(trained / "predictor")
    with pytest.raises(ValueError) as core:
        check_alpha(1.5)
    with pytest.raises(ValueError) as ours:
        predictor.recalibrate(raw["cal"], data.cal.labels, alpha=1.5)
    assert str(ours.value) == str(core.value) == "alpha must be in the open interval (0, 1); got 1.5"
    # alpha 0.1 needs n >= 9 (ceil((n + 1) 0.9) <= n): with 8 points q is infinite, every set is every class
    with pytest.warns(UserWarning, match="alpha=0.1 needs at least 9 calibration points"):
        few = predictor.recalibrate(raw["cal"][:8], data.cal.labels[:8])
    assert few.thresholds == {score: math.inf for score in score_names()}
    assert few.predict_sets(raw["test"][:5]).mask.all()
    assert few.info["scores"]["hps"]["threshold"] is None  # JSON has no infinity
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isfinite(predictor.recalibrate(raw["cal"][:9], data.cal.labels[:9]).thresholds["hps"])


def test_bad_inputs_and_labels_are_named_in_one_line(trained, digits):
    data, raw = digits
    predictor = Predictor.load(trained / "predictor")
    cases = [
        (torch.zeros(3, 8, 7), r"inputs must have shape \[n, 1, 8, 8\] \(or \[n, 8, 8\], or \[n, 64\] flattened\); got \[3, 8, 7\]"),
        (torch.zeros(3, 3, 8, 8), r"got \[3, 3, 8, 8\]: 3 channels where the model takes 1"),
        ([["a", "b"]], "inputs must be numbers"),
        (torch.zeros(2, 64, dtype=torch.bool), "inputs must be numbers .*; got bool"),
        (torch.full((2, 64), math.nan), "inputs hold NaN or infinite values .*first at position 0"),
    ]
    for x, message in cases:
        with pytest.raises(InputError, match=message):
            predictor.predict_sets(x)
    with pytest.raises(InputError, match=r"labels must lie in 0..9; found 0..10"):
        predictor.recalibrate(raw["cal"][:10], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 10]))
    with pytest.raises(InputError, match="y_cal must hold one label per input: 10 inputs, 9 labels"):
        predictor.recalibrate(raw["cal"][:10], data.cal.labels[:9])
    with pytest.raises(ValueError, match="score must be one of hps, aps, raps, saps, topk, margin; got 'lac'"):
        predictor.predict_sets(raw["test"][:2], "lac")
    empty = predictor.predict_sets(raw["test"][:0])
    assert empty.mask.shape == (0, 10) and empty.lists == []


def test_an_uncalibrated_predictor_says_what_to_do():
    with pytest.raises(PredictorError, match=r"no calibrated threshold for hps \(it has: none\); call recalibrate"):
        toy_predictor().predict_sets(torch.zeros(1, 2))


# ----------------------------------------------------------------------------- class-conditional calibration and p-values


def toy_calibration(seed=0, n=120):
    """Probabilities of three classes, class 2 rare (5 of ``n``), with ties (a tenth of the rows the same)."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, 3, generator=generator, dtype=torch.float64) * 2, dim=1)
    probs[: n // 10] = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    labels = torch.arange(n) % 2
    labels[-5:] = 2
    return probs, labels


def test_class_thresholds_are_a_per_class_loop_and_a_short_class_is_in_every_set_and_named():
    probs, labels = toy_calibration()
    spec = InputSpec((2,), 1.0, 0.0, 1.0, "two features")
    named = Predictor.create(build_model("mlp", 3, input_shape=(2,)), architecture="mlp", input_spec=spec, num_classes=3, alpha=0.1,
                             class_names=["ant", "bee", "cicada"], device="cpu")
    with pytest.warns(UserWarning, match=r"alpha=0.1 needs at least 9 calibration points of a class; 1 class has fewer -- 2 \('cicada', 5\): "
                                         r"every prediction set holds them"):
        predictor = named.calibrated(probs, labels, 0.1, by="class", example_ids=torch.arange(120), data="toy")
    assert predictor.calibrated_by == "class" and predictor.info["format_version"] == 2 and "class-conditional sets" in repr(predictor)
    for score in score_names():
        entry = predictor.info["scores"][score]
        calibration_scores = predictor.score_matrix(probs, score, torch.arange(120)).gather(1, labels[:, None]).squeeze(1)
        for label in range(3):
            own = sorted(calibration_scores[labels == label].tolist())
            assert entry["calibration_scores"][label] == own
            rank = math.ceil((len(own) + 1) * 0.9 - 1e-12)  # the exact quantile, class by class, with a sort
            assert entry["class_thresholds"][label] == (own[rank - 1] if rank <= len(own) else None), (score, label)
        assert predictor.fallback_classes(score) == [2]
        new = torch.softmax(torch.randn(50, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64), dim=1)
        mask = predictor.sets_from_proba(new, score, example_ids=torch.arange(500, 550)).mask  # the predictor's own: class-conditional
        scores = predictor.score_matrix(new, score, torch.arange(500, 550))
        assert torch.equal(mask, scores <= predictor.class_thresholds(score)) and mask[:, 2].all()
        marginal = predictor.sets_from_proba(new, score, calibration="marginal", example_ids=torch.arange(500, 550)).mask
        assert torch.equal(marginal, scores <= predictor.threshold(score))
    with warnings.catch_warnings():  # marginal by default: nothing to warn of, the class thresholds are recorded all the same
        warnings.simplefilter("error")
        plain = named.calibrated(probs, labels, 0.1, data="toy")
    assert plain.calibrated_by == "marginal" and plain.info["format_version"] == 1 and plain.fallback_classes("hps") == [2]
    with pytest.raises(ValueError, match="calibration must be one of marginal, class, cluster, rc3p, risk; got 'mondrian'"):
        plain.predict_sets(torch.zeros(1, 2), calibration="mondrian")


@pytest.mark.parametrize("score", score_names())
def test_the_sets_at_alpha_are_the_classes_whose_p_value_exceeds_alpha(score):
    probs, labels = toy_calibration(2)
    for by in ("marginal", "class"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # class 2 is short
            predictor = toy_predictor(0.1).calibrated(probs, labels, 0.1, by=by, example_ids=torch.arange(120), data="toy")
        new = torch.softmax(torch.randn(200, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64), dim=1)
        new[:20] = probs[:20]  # ties with calibration scores
        ids = torch.arange(20, 220) % 150
        for calibration in ("marginal", "class", None):
            p = predictor.p_values_from_proba(new, score, calibration=calibration, example_ids=ids)
            mask = predictor.sets_from_proba(new, score, calibration=calibration, example_ids=ids).mask
            assert torch.equal(mask, p > 0.1), (score, by, calibration)
            assert ((p > 0) & (p <= 1)).all()
    # the smoothed p-values: below the plain ones by at most tau (#ties + 1) / (n + 1), a pure function of the ids
    smoothed = predictor.p_values_from_proba(new, score, calibration="marginal", example_ids=ids, smoothed=True)
    plain = predictor.p_values_from_proba(new, score, calibration="marginal", example_ids=ids)
    assert (smoothed <= plain).all() and not torch.equal(smoothed, plain)
    assert torch.equal(smoothed[5:9], predictor.p_values_from_proba(new[5:9], score, calibration="marginal", example_ids=ids[5:9],
                                                                    smoothed=True))


def test_p_values_of_raw_inputs_give_the_trained_predictor_s_sets(trained, digits):
    data, raw = digits
    predictor = Predictor.load(trained / "predictor").recalibrate(raw["cal"], data.cal.labels, by="class", example_ids=data.cal.ids)
    for score in ("hps", "saps"):
        for calibration in ("marginal", "class"):
            p = predictor.p_values(raw["test"].numpy(), score, calibration=calibration)
            assert isinstance(p, np.ndarray) and p.shape == (len(raw["test"]), 10)
            assert np.array_equal(p > predictor.alpha, predictor.predict_sets(raw["test"].numpy(), score, calibration=calibration).mask)


def test_a_predictor_of_an_earlier_format_loads_and_says_what_it_lacks(trained, tmp_path):
    directory = copy_of(trained, tmp_path)
    info = read_checked_json(directory / INFO_FILE)
    for entry in info["scores"].values():  # as predictors were written before class thresholds and p-values
        for field in ("class_thresholds", "calibration_scores", "cluster_thresholds", "clusters", "rc3p_thresholds", "rc3p_rank_limits"):
            del entry[field]
    del info["calibration"]["by"]
    write_checked_json(directory / INFO_FILE, info)
    old = Predictor.load(directory)
    assert old.calibrated_by == "marginal" and old.predict_sets(torch.zeros(2, 64)).mask.shape == (2, 10)
    with pytest.raises(PredictorError, match=r"no class thresholds \(written before class-conditional calibration\); recalibrate"):
        old.predict_sets(torch.zeros(2, 64), calibration="class")
    with pytest.raises(PredictorError, match=r"no calibration scores \(written before p-values\); recalibrate"):
        old.p_values(torch.zeros(2, 64))


def test_bad_class_thresholds_and_calibration_scores_are_refused_by_field(trained, tmp_path):
    directory = copy_of(trained, tmp_path)
    info = read_checked_json(directory / INFO_FILE)
    for change, field in (
        (lambda i: i["scores"]["aps"].update(class_thresholds=[0.5] * 9), "scores.aps.class_thresholds must be 10 finite numbers"),
        (lambda i: i["scores"]["hps"]["calibration_scores"][3].reverse(), "scores.hps.calibration_scores must be 10 ascending lists"),
        (lambda i: i["scores"]["hps"]["calibration_scores"][3].pop(), "scores.hps.calibration_scores must be .* 200 in all"),
        (lambda i: i["calibration"].update(by="mondrian"), "calibration.by must be one of marginal, class"),
        (lambda i: (i["calibration"].update(by="class"), i["scores"]["topk"].pop("class_thresholds")),
         r"scores.topk.class_thresholds must be 10 finite numbers or nulls \(infinite\) \(calibration.by is class\)"),
    ):
        changed = json.loads(json.dumps(info))
        change(changed)
        write_checked_json(directory / INFO_FILE, changed)
        with pytest.raises(PredictorError, match=field):
            Predictor.load(directory)


# ----------------------------------------------------------------------------- what loading refuses


def copy_of(trained, tmp_path) -> Path:
    return Predictor.load(trained / "predictor").save(tmp_path / "p")


def test_changed_weights_are_refused_by_their_sha256(trained, tmp_path):
    directory = copy_of(trained, tmp_path)
    data = bytearray((directory / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 1
    (directory / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(PredictorError, match=r"weights.pt does not match the sha256 recorded in .*predictor.json \(weights.sha256\)"):
        Predictor.load(directory)


def test_a_newer_format_a_changed_card_and_missing_files_are_refused(trained, tmp_path):
    directory = copy_of(trained, tmp_path)
    info = read_checked_json(directory / INFO_FILE)
    write_checked_json(directory / INFO_FILE, {**info, "format_version": FORMAT_VERSION + 1})
    with pytest.raises(PredictorError, match=f"format_version {FORMAT_VERSION + 1} is newer than this dpsm_ray .* reads \\(up to {FORMAT_VERSION}\\); upgrade"):
        Predictor.load(directory)
    write_checked_json(directory / INFO_FILE, {k: v for k, v in info.items() if k != "alpha"})
    with pytest.raises(PredictorError, match="field alpha is missing"):
        Predictor.load(directory)
    stored = json.loads((directory / INFO_FILE).read_text())
    stored["payload"] = {**info, "alpha": 0.5}  # edited by hand: the checksum no longer matches
    (directory / INFO_FILE).write_text(json.dumps(stored))
    with pytest.raises(PredictorError, match="predictor.json does not match the sha256 recorded in it"):
        Predictor.load(directory)
    write_checked_json(directory / INFO_FILE, info)
    (directory / WEIGHTS_FILE).unlink()
    with pytest.raises(PredictorError, match=r"weights.pt is missing \(named by .*predictor.json, field weights.file\)"):
        Predictor.load(directory)
    (directory / INFO_FILE).unlink()
    with pytest.raises(PredictorError, match="predictor.json is missing: a predictor directory holds predictor.json and weights.pt"):
        Predictor.load(directory)
    with pytest.raises(PredictorError, match="no such directory"):
        Predictor.load(tmp_path / "nowhere")


class Planted:
    """Unpickling this would create the file named in it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_nothing_in_a_predictor_directory_is_executed(trained, tmp_path):
    directory = copy_of(trained, tmp_path)
    marker = tmp_path / "executed"
    torch.save({"net.0.weight": Planted(str(marker))}, directory / WEIGHTS_FILE)
    info = read_checked_json(directory / INFO_FILE)
    info["weights"]["sha256"] = sha256_file(directory / WEIGHTS_FILE)
    write_checked_json(directory / INFO_FILE, info)  # a matching sha256: only weights_only stands in the way
    with pytest.raises(PredictorError, match="weights.pt is not a state dict of tensors"):
        Predictor.load(directory)
    assert not marker.exists()
    info["weights"]["file"] = "../outside.pt"
    write_checked_json(directory / INFO_FILE, info)
    with pytest.raises(PredictorError, match="field weights.file must be a file name inside the predictor directory"):
        Predictor.load(directory)


def test_weights_of_another_model_are_refused_by_name(trained, tmp_path):
    directory = copy_of(trained, tmp_path)
    info = read_checked_json(directory / INFO_FILE)
    info["model"]["num_classes"] = 11
    info["class_names"] = None
    for entry in info["scores"].values():  # per-class fields of 10 classes would be refused first
        for field in ("class_thresholds", "calibration_scores", "cluster_thresholds", "clusters", "rc3p_thresholds", "rc3p_rank_limits"):
            del entry[field]
    write_checked_json(directory / INFO_FILE, info)
    with pytest.raises(PredictorError, match="weights.pt does not hold the weights of a mlp with 11 classes"):
        Predictor.load(directory)


# ----------------------------------------------------------------------------- without Ray


def test_from_dpsm_ray_import_predictor_predicts_in_a_fresh_process_without_ray(trained, digits, tmp_path):
    _, raw = digits
    import numpy

    numpy.save(tmp_path / "x.npy", raw["test"][:5].numpy())
    code = (
        "import sys, numpy\n"
        "from dpsm_ray import Predictor\n"
        f"predictor = Predictor.load({str(trained / 'predictor')!r})\n"
        f"mask, sets = predictor.predict_sets(numpy.load({str(tmp_path / 'x.npy')!r}), score='aps')\n"
        "print(sets)\n"
        "assert 'ray' not in sys.modules and 'pandas' not in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'pandas'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = Predictor.load(trained / "predictor").predict_sets(raw["test"][:5], score="aps").lists
    assert result.stdout.strip() == str(expected)


def test_each_method_s_predictor_is_chosen_on_validation_data_alone():
    from dpsm_ray.predict.export import choose

    def entry(method, seed, size, cover, test_size):
        return {"name": f"{method}-seed{seed}", "method": method, "seed": seed, "val_set_size": size, "val_coverage": cover,
                "test": {"scores": {"hps": {"set_size": test_size}}}}

    entries = [
        entry("dpsm", 0, 1.2, 0.90, 9.0), entry("dpsm", 1, 1.1, 0.85, 1.0),  # seed 1 is smaller but below the floor 0.88
        entry("dpsm", 2, 1.2, 0.95, 0.5),  # a tie with seed 0 on validation: the lower seed, whatever the test says
        entry("ce", 0, 2.0, 0.80, 1.0), entry("ce", 1, 1.0, 0.85, 1.0),  # none reaches the floor: the highest coverage
    ]
    from dpsm_ray.storage.layout import CoverageFloor

    assert choose(entries, CoverageFloor(0.1, 0.02)) == {"dpsm": "dpsm-seed0", "ce": "ce-seed1"}


def test_a_predictor_whose_model_is_ones_own_factory_loads_only_when_trusted(tmp_path, monkeypatch, capsys):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "my_digit_nets.py").write_text(
        "from torch import nn\n"
        "def small(num_classes):\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    assert main(["train", "--dataset", "digits", "--model", "my_digit_nets:small", "--method", "ce", "--epochs", "2", "--eval-splits", "2",
                 "--out", str(tmp_path / "run")]) == 0
    assert "--out sets.parquet --trust-code" in capsys.readouterr().out  # the closing hint runs as printed
    torch.save(torch.load(tmp_path / "run" / "model.pt", weights_only=True), tmp_path / "w.pt")
    assert main(["calibrate", "--model", "my_digit_nets:small", "--weights", str(tmp_path / "w.pt"), "--dataset", "digits", "--prepare",
                 "card", "--out", str(tmp_path / "cal")]) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    np.save(tmp_path / "X.npy", np.zeros((3, 64), np.float32))
    command = hint.split("use it with dpsm-ray ", 1)[1].replace("X.npy", str(tmp_path / "X.npy")).replace("sets.parquet", str(tmp_path / "s.parquet"))
    assert command.endswith("--trust-code") and main(command.split()) == 0
    with pytest.raises(PredictorError, match=r"its model, my_digit_nets:small, is code to import and run; load it with trust_code=True"):
        Predictor.load(tmp_path / "run" / "predictor")
    predictor = Predictor.load(tmp_path / "run" / "predictor", trust_code=True)
    assert predictor.info["model"]["architecture"] == "my_digit_nets:small"
    np.save(tmp_path / "x.npy", np.zeros((3, 64), np.float32))
    with pytest.raises(SystemExit):
        main(["predict", str(tmp_path / "run" / "predictor"), "--input", str(tmp_path / "x.npy"), "--out", str(tmp_path / "sets.parquet")])
    assert "--trust-code" in capsys.readouterr().err
    assert main(["predict", str(tmp_path / "run" / "predictor"), "--input", str(tmp_path / "x.npy"), "--out", str(tmp_path / "sets.parquet"), "--trust-code"]) == 0


def test_a_long_export_says_its_first_model_then_one_line_a_while_and_its_last_with_the_time_left(monkeypatch):
    from dpsm_ray.predict import export

    now = [100.0]
    monkeypatch.setattr(export.time, "monotonic", lambda: now[0])
    lines = []
    progress = export.ExportProgress(5, lines.append, every=15.0)
    for seconds in (5, 5, 5, 5, 5):  # a model each 5 s: lines at 5 s, 20 s and the last, 25 s
        now[0] += seconds
        progress.ended(f"m{len(lines)}", " (process 7 on h)")
    assert lines == ["predictors: m0 written (process 7 on h), 1 of 5, about 20s left",
                     "predictors: m1 written (process 7 on h), 4 of 5, about 5s left",
                     "predictors: m2 written (process 7 on h), 5 of 5"]


def test_a_sweep_s_or_a_run_s_directory_given_as_a_predictor_says_where_its_predictors_are(trained, tmp_path):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text("{}")
    with pytest.raises(PredictorError, match=r"sweep is a sweep's results directory, not a predictor: its final models are predictors under "
                                             r".*sweep/predictors/ \(e.g. METHOD-seed0\), and dpsm-ray export .*sweep --method METHOD --out DIR"):
        Predictor.load(tmp_path / "sweep")
    with pytest.raises(PredictorError, match=r"is a training run's --out, not a predictor: its predictor is .*/predictor$"):
        Predictor.load(trained)
