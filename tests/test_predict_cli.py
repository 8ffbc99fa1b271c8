"""``dpsm-ray predict`` on the inputs users have: .npy, .npz, Parquet tables and folders of images."""

import json
import re

import numpy
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from dpsm_ray.cli import main
from dpsm_ray.cards import load_splits
from dpsm_ray.cards import build_model
from dpsm_ray.predict.predictions import read_metadata
from dpsm_ray.predict.predictor import Predictor


@pytest.fixture(scope="module")
def digits_predictor(tmp_path_factory):
    """A digits MLP (untrained: the sets need not be good, only right) calibrated on the calibration split."""
    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=10, alpha=0.1, class_names=data.class_names,
                                 uniform_seed=3, device="cpu")
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, example_ids=data.cal.ids)
    directory = predictor.save(tmp_path_factory.mktemp("predictor") / "digits")
    return directory, predictor, data.test.source.inputs[data.test.ids][:50]


def predict(*argv) -> int:
    return main(["predict", *map(str, argv)])


def test_npy_rows_are_the_predictor_s_sets_with_names_and_metadata(digits_predictor, tmp_path):
    directory, predictor, x = digits_predictor
    numpy.save(tmp_path / "x.npy", x.numpy())
    assert predict(directory, "--input", tmp_path / "x.npy", "--out", tmp_path / "sets.parquet") == 0
    table = pq.read_table(tmp_path / "sets.parquet")
    assert table.schema.names == ["input_id", "set", "set_names", "set_size", "top1", "top1_name"]
    assert [str(t) for t in table.schema.types] == ["int64", "list<element: int32>", "list<element: string>", "int32", "int32", "string"]
    rows = table.to_pylist()
    expected = predictor.predict_sets(x)
    probs = predictor.predict_proba(x)
    assert [r["input_id"] for r in rows] == list(range(50))
    assert [r["set"] for r in rows] == expected.lists and [r["set_size"] for r in rows] == [len(s) for s in expected.lists]
    assert [r["set_names"] for r in rows] == [[str(k) for k in s] for s in expected.lists]
    assert [r["top1"] for r in rows] == probs.argmax(1).tolist() and [r["top1_name"] for r in rows] == [str(k) for k in probs.argmax(1).tolist()]
    assert read_metadata(tmp_path / "sets.parquet") == {"run_id": None, "score": "hps", "calibration": "marginal", "alpha": 0.1,
                                                        "threshold": predictor.thresholds["hps"], "non_empty": False, "p_values": False}


@pytest.mark.parametrize("score", ["hps", "aps", "saps", "topk", "margin"])
@pytest.mark.parametrize("calibration", ["marginal", "class"])
def test_p_values_give_the_predictor_s_sets_marginal_and_class_conditional(digits_predictor, tmp_path, capsys, score, calibration):
    directory, predictor, x = digits_predictor
    numpy.savez(tmp_path / "x.npz", x=x.numpy(), ids=numpy.arange(700, 750))
    out = tmp_path / "sets.parquet"
    assert predict(directory, "--input", tmp_path / "x.npz", "--out", out, "--score", score, "--calibration", calibration, "--p-values") == 0
    table = pq.read_table(out)
    assert table.schema.names[-10:] == [f"p_value_{k}" for k in range(10)] and str(table.schema.types[-1]) == "double"
    rows = table.to_pylist()
    p = torch.tensor([[r[f"p_value_{k}"] for k in range(10)] for r in rows], dtype=torch.float64)
    ids = torch.arange(700, 750)
    assert [r["set"] for r in rows] == predictor.predict_sets(x, score, calibration=calibration, example_ids=ids).lists
    assert [r["set"] for r in rows] == [(row > predictor.alpha).nonzero().flatten().tolist() for row in p]  # the identity
    assert torch.equal(p, predictor.p_values(x, score, calibration=calibration, example_ids=ids))
    metadata = read_metadata(out)
    assert metadata["calibration"] == calibration and metadata["p_values"] is True
    if calibration == "class":
        assert metadata["threshold"] is None and len(metadata["class_thresholds"]) == 10
        assert re.search(rf"{score.upper()} sets at alpha=0.1 \(class-conditional: q [\d.]+ \.\. [\d.]+ over 10 classes\)", capsys.readouterr().out)
    else:
        assert metadata["threshold"] == predictor.thresholds[score]


def test_class_conditional_sets_warn_of_a_class_with_too_few_calibration_points(digits_predictor, tmp_path, capsys):
    _, predictor, x = digits_predictor
    data = load_splits("digits", seed=0)
    keep = (data.cal.labels != 7) | (torch.arange(len(data.cal)) % 5 == 0)  # about a fifth of the sevens: 5, fewer than alpha 0.1's 9
    with pytest.warns(UserWarning, match=r"1 class has fewer -- 7 \('7', 5\): every prediction set holds them"):
        short = predictor.recalibrate(data.cal.source.inputs[data.cal.ids][keep], data.cal.labels[keep], by="class",
                                      example_ids=data.cal.ids[keep])
    directory = short.save(tmp_path / "short")
    numpy.save(tmp_path / "x.npy", x.numpy())
    assert predict(directory, "--input", tmp_path / "x.npy", "--out", tmp_path / "sets.json") == 0  # class-conditional: its own
    captured = capsys.readouterr()
    assert "warning: 1 class had too few calibration points for a finite threshold at alpha=0.1 -- 7 ('7'): every class-conditional set" \
        " holds them" in captured.err
    written = json.loads((tmp_path / "sets.json").read_text())
    assert written["dpsm_ray"]["class_thresholds"][7] is None and all(7 in row["set"] for row in written["rows"])
    assert [row["set"] for row in written["rows"]] == short.predict_sets(x).lists


def test_an_earlier_predictor_without_class_thresholds_or_scores_is_refused_before_reading_inputs(digits_predictor, tmp_path, capsys):
    from dpsm_ray.files import read_checked_json, write_checked_json

    directory, predictor, x = digits_predictor
    old = predictor.save(tmp_path / "old")
    info = read_checked_json(old / "predictor.json")
    for entry in info["scores"].values():
        del entry["class_thresholds"], entry["calibration_scores"]
    write_checked_json(old / "predictor.json", info)
    for option, message in (("--calibration", "no class thresholds"), ("--p-values", "no calibration scores")):
        argv = [option, "class"] if option == "--calibration" else [option]
        with pytest.raises(SystemExit) as exit_info:
            predict(old, "--input", tmp_path / "missing.npy", "--out", tmp_path / "sets.parquet", *argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_non_empty_fills_only_the_empty_sets_with_the_top_class(digits_predictor, tmp_path):
    _, predictor, x = digits_predictor
    data = load_splits("digits", seed=0)
    # at alpha 0.8 the untrained model's HPS threshold leaves some sets empty
    predictor = predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels, alpha=0.8, example_ids=data.cal.ids)
    directory = predictor.save(tmp_path / "predictor")
    numpy.save(tmp_path / "x.npy", x.numpy())
    plain = predictor.predict_sets(x)
    assert any(not s for s in plain.lists) and any(s for s in plain.lists)
    assert predict(directory, "--input", tmp_path / "x.npy", "--out", tmp_path / "sets.parquet", "--non-empty") == 0
    rows = pq.read_table(tmp_path / "sets.parquet").to_pylist()
    top1 = predictor.predict_proba(x).argmax(1).tolist()
    assert [r["set"] for r in rows] == [s if s else [top] for s, top in zip(plain.lists, top1)] and all(r["set_size"] >= 1 for r in rows)
    assert read_metadata(tmp_path / "sets.parquet")["non_empty"] is True


def test_npz_ids_draw_the_aps_uniforms_and_large_inputs_show_progress(digits_predictor, tmp_path, capsys):
    directory, predictor, x = digits_predictor
    ids = numpy.arange(900, 950)
    numpy.savez(tmp_path / "x.npz", x=x.reshape(50, 64).numpy(), ids=ids)
    assert predict(directory, "--input", tmp_path / "x.npz", "--out", tmp_path / "a.parquet", "--score", "aps", "--batch-size", "3", "--probabilities") == 0
    rows = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert [r["input_id"] for r in rows] == ids.tolist()
    assert [r["set"] for r in rows] == predictor.predict_sets(x, "aps", example_ids=torch.from_numpy(ids), batch_size=3).lists
    # the same forward passes give the same bits; other batch shapes round float32 matmuls differently
    assert numpy.array_equal([r["probabilities"] for r in rows], predictor.predict_proba(x, batch_size=3).numpy())
    assert numpy.allclose([r["probabilities"] for r in rows], predictor.predict_proba(x).numpy(), rtol=0, atol=1e-6)
    # 17 forward passes of 3: a progress bar on stderr
    assert "50/50" in capsys.readouterr().err


def test_a_parquet_table_of_feature_columns(digits_predictor, tmp_path):
    directory, predictor, x = digits_predictor
    flat = x.reshape(50, 64).numpy()
    table = pa.table({"id": [f"digit-{i}" for i in range(50)], **{f"pixel{j}": flat[:, j] for j in range(64)}})
    pq.write_table(table, tmp_path / "x.parquet")
    assert predict(directory, "--input", tmp_path / "x.parquet", "--out", tmp_path / "t.parquet") == 0
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert [r["input_id"] for r in rows] == [f"digit-{i}" for i in range(50)] and [r["set"] for r in rows] == predictor.predict_sets(x).lists


def test_a_folder_of_images_is_read_as_the_predictor_says_and_other_files_are_skipped(digits_predictor, tmp_path, capsys):
    directory, predictor, x = digits_predictor
    folder = tmp_path / "images"
    (folder / "more").mkdir(parents=True)
    # digits' 0..16 as 8-bit gray levels: the predictor reads a level g back as g * 16 / 255
    levels = numpy.round(x[:6, 0].numpy() * 255 / 16).astype(numpy.uint8)
    names = ["a.png", "b.png", "c.png", "more/d.png", "more/e.png", "more/f.png"]
    for name, image in zip(names, levels):
        Image.fromarray(image, mode="L").save(folder / name)
    (folder / "README.txt").write_text("not an image")
    # as training refuses a file of a folder: that is not an image, unless told to leave such files out
    with pytest.raises(SystemExit) as ended:
        predict(directory, "--input", folder, "--out", tmp_path / "f.parquet")
    err = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2 and len(err) == 1 and "README.txt is not an image" in err[0] and "--skip-unreadable" in err[0]
    assert predict(directory, "--input", folder, "--out", tmp_path / "f.parquet", "--skip-unreadable") == 0
    rows = pq.read_table(tmp_path / "f.parquet").to_pylist()
    assert [r["input_id"] for r in rows] == names
    read_back = torch.from_numpy(levels[:, None].astype(numpy.float32) * numpy.float32(16 / 255))
    assert [r["set"] for r in rows] == predictor.predict_sets(read_back).lists
    assert "skipped 1 files that are not readable images (--skip-unreadable; e.g. README.txt)" in capsys.readouterr().err
    # one image file is an input too
    assert predict(directory, "--input", folder / "more" / "d.png", "--out", tmp_path / "one.parquet") == 0
    assert [r["set"] for r in pq.read_table(tmp_path / "one.parquet").to_pylist()] == predictor.predict_sets(read_back[3:4]).lists
    # a truncated PNG (its header reads, its pixels do not): refused naming it, as training refuses it
    (folder / "README.txt").unlink()
    (folder / "g.png").write_bytes((folder / "a.png").read_bytes()[:-30])
    with pytest.raises(SystemExit) as ended:
        predict(directory, "--input", folder, "--out", tmp_path / "f.parquet")
    assert ended.value.code == 2 and "g.png cannot be decoded, a truncated or corrupt image" in capsys.readouterr().err


@pytest.mark.parametrize("make,message", [
    (lambda p: numpy.save(p / "x.npy", numpy.zeros((4, 8, 7))), r"inputs must have shape \[n, 1, 8, 8\] \(or \[n, 8, 8\], or \[n, 64\] flattened\); got \[4, 8, 7\]"),
    (lambda p: numpy.save(p / "x.npy", numpy.array([{"a": 1}], dtype=object), allow_pickle=True), "x.npy cannot be read as a numpy array"),
    (lambda p: numpy.savez(p / "x.npz", a=numpy.zeros((2, 64)), b=numpy.zeros((2, 64))), "an .npz must hold the inputs as 'x'"),
    (lambda p: pq.write_table(pa.table({"f": [1.0]}), p / "x.parquet"), "the predictor takes 64 features .* the table has 1 columns"),
    (lambda p: (p / "x.csv").write_text("a,b\n1,2\n"), "the predictor takes 64 features .* the table has 2 columns besides .id."),
    (lambda p: (p / "y.csv").write_text(""), "y.csv is not a readable CSV file"),
    (lambda p: (p / "x.json").write_text("[1, 2]"), "give an .npy or .npz array, a .parquet or .csv table of feature columns, an image, or a folder of images"),
    (lambda p: (p / "x").mkdir(), "no image file PIL can read under it"),
])
def test_unreadable_inputs_fail_in_one_line_naming_them(digits_predictor, tmp_path, capsys, make, message):
    directory = digits_predictor[0]
    make(tmp_path)
    path = next(p for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        predict(directory, "--input", path, "--out", tmp_path / "out.parquet")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out.parquet").exists()


def test_a_bad_predictor_directory_fails_in_one_line(tmp_path, capsys):
    numpy.save(tmp_path / "x.npy", numpy.zeros((1, 64)))
    with pytest.raises(SystemExit) as exit_info:
        predict(tmp_path, "--input", tmp_path / "x.npy", "--out", tmp_path / "o.parquet")
    assert exit_info.value.code == 2 and f"{tmp_path / 'predictor.json'} is missing" in capsys.readouterr().err


def test_a_tabular_predictor_takes_no_images(tmp_path, capsys):
    data = load_splits("synthetic:classes=3,dim=4,size=300", seed=0)
    model = build_model("mlp", 3, input_shape=data.input_shape)
    predictor = Predictor.create(model, architecture="mlp", input_spec=data.input_spec, num_classes=3, alpha=0.1, device="cpu")
    predictor.recalibrate(data.cal.source.inputs[data.cal.ids], data.cal.labels).save(tmp_path / "p")
    (tmp_path / "images").mkdir()
    with pytest.raises(SystemExit):
        predict(tmp_path / "p", "--input", tmp_path / "images", "--out", tmp_path / "o.parquet")
    assert "the predictor takes 4 real features of the generated synthetic:classes=3,dim=4,size=300 data, not images" in capsys.readouterr().err
    assert json.loads(json.dumps(predictor.info["input"]))["image"] is None


def test_an_unknown_device_is_named(digits_predictor, tmp_path, capsys):
    numpy.save(tmp_path / "x.npy", numpy.zeros((1, 64)))
    with pytest.raises(SystemExit) as exit_info:
        predict(digits_predictor[0], "--input", tmp_path / "x.npy", "--out", tmp_path / "o.parquet", "--device", "gpu")
    assert exit_info.value.code == 2 and "device must be auto, cpu, cuda or cuda:N; got 'gpu'" in capsys.readouterr().err


# --- a predictor trained on a table: its features by name, its labels, the output formats -----------------------------------------

@pytest.fixture(scope="module")
def table_predictor(tmp_path_factory):
    """scikit-learn's breast-cancer table (30 named features, label 'diagnosis' as names), trained for 3 epochs by
    ``dpsm-ray train --out``: the predictor a researcher gets from their own table."""
    import pandas as pd
    from sklearn.datasets import load_breast_cancer

    root = tmp_path_factory.mktemp("table")
    frame = load_breast_cancer(as_frame=True).frame.rename(columns={"target": "diagnosis"})
    frame["diagnosis"] = frame["diagnosis"].map({0: "malignant", 1: "benign"})
    frame.to_csv(root / "cancer.csv", index=False)
    assert main(["train", "--dataset", f"table:{root / 'cancer.csv'}:label=diagnosis", "--epochs", "3", "--out", str(root / "run")]) == 0
    # both classes among the rows predicted below, so that a wrong column order shows
    rows = frame.iloc[[0, 1, 19, 20, 21, 37, 40, 44]]
    assert set(rows.diagnosis) == {"malignant", "benign"}
    return root / "run" / "predictor", frame, rows


def test_a_table_predictor_records_its_features_and_reads_a_table_by_name_in_any_order(table_predictor, tmp_path, capsys):
    directory, frame, rows = table_predictor
    predictor = Predictor.load(directory, device="cpu")
    features = [c for c in frame.columns if c != "diagnosis"]
    assert predictor.feature_names == tuple(features) and predictor.label_column == "diagnosis"
    expected = predictor.predict_sets(rows[features].to_numpy(dtype=numpy.float32)).lists
    rows[features].to_csv(tmp_path / "ordered.csv", index=False)
    rows[list(reversed(features))].to_csv(tmp_path / "reversed.csv", index=False)  # the same rows, columns reversed
    for name in ("ordered", "reversed"):
        assert predict(directory, "--input", tmp_path / f"{name}.csv", "--out", tmp_path / f"{name}.parquet") == 0
        assert [list(s) for s in pq.read_table(tmp_path / f"{name}.parquet").column("set").to_pylist()] == expected, name
    # read by position, the reversed columns give other sets: the test would catch a positional read
    assert predictor.predict_sets(rows[list(reversed(features))].to_numpy(dtype=numpy.float32)).lists != expected
    # the Python face takes JSON-like records by name too
    records = [dict(reversed(list(row.items()))) for row in rows[features].to_dict("records")]
    assert numpy.array_equal(predictor.named_inputs(records), rows[features].to_numpy(dtype=numpy.float64))


@pytest.mark.parametrize("change,message", [
    (lambda t: t.drop(columns=["mean radius", "worst area"]), r"missing 'mean radius', 'worst area'"),
    (lambda t: t.assign(extra=1.0), r"unexpected 'extra'"),
    (lambda t: t.rename(columns={"mean radius": "radius"}), r"missing 'mean radius' and unexpected 'radius'"),
])
def test_a_table_missing_or_adding_a_feature_is_refused_in_one_line_naming_it(table_predictor, tmp_path, capsys, change, message):
    directory, frame, rows = table_predictor
    change(rows.drop(columns=["diagnosis"])).to_csv(tmp_path / "x.csv", index=False)
    with pytest.raises(SystemExit) as exit_info:
        predict(directory, "--input", tmp_path / "x.csv", "--out", tmp_path / "o.parquet")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and re.search(message, err[0]), err
    assert "the predictor reads its 30 features by name" in err[0]
    with pytest.raises(ValueError, match="features it trained on, by name"):
        Predictor.load(directory, device="cpu").named_inputs(change(rows.drop(columns=["diagnosis"])).to_dict("records"))


def test_labelled_inputs_report_coverage_and_every_format_writes_the_same_rows(table_predictor, tmp_path, capsys):
    directory, frame, rows = table_predictor
    predictor = Predictor.load(directory, device="cpu")
    rows.to_csv(tmp_path / "labelled.csv", index=False)  # the training layout, label column included
    written = {}
    for suffix in ("parquet", "csv", "json", "jsonl"):
        assert predict(directory, "--input", tmp_path / "labelled.csv", "--out", tmp_path / f"sets.{suffix}") == 0
        out = capsys.readouterr().out
    import pandas as pd

    written["parquet"] = pq.read_table(tmp_path / "sets.parquet").to_pylist()
    written["csv"] = [{k: json.loads(v) if k in ("set", "set_names") else v for k, v in r.items()}
                      for r in pd.read_csv(tmp_path / "sets.csv").to_dict("records")]
    document = json.loads((tmp_path / "sets.json").read_text())
    written["json"] = document["rows"]
    written["jsonl"] = [json.loads(line) for line in (tmp_path / "sets.jsonl").read_text().splitlines()]
    labels = [predictor.class_names.index(name) for name in rows.diagnosis]
    for form, table in written.items():
        assert [r["label"] for r in table] == labels, form
        assert [bool(r["covered"]) for r in table] == [y in r["set"] for y, r in zip(labels, table)], form
        assert [list(r["set"]) for r in table] == [list(r["set"]) for r in written["parquet"]], form
    assert document["dpsm_ray"]["score"] == "hps" and document["dpsm_ray"]["alpha"] == predictor.alpha
    coverage = sum(r["covered"] for r in written["parquet"]) / len(labels)
    assert f"labelled inputs: coverage {coverage:.3f} (target 0.9)" in out


def test_an_npz_with_labels_y_reports_coverage_and_a_bad_format_is_named(digits_predictor, tmp_path, capsys):
    directory, predictor, x = digits_predictor
    y = load_splits("digits", seed=0).test.labels[:50].numpy()
    numpy.savez(tmp_path / "x.npz", x=x.numpy(), y=y)
    assert predict(directory, "--input", tmp_path / "x.npz", "--out", tmp_path / "s.parquet") == 0
    table = pq.read_table(tmp_path / "s.parquet").to_pylist()
    sets = predictor.predict_sets(x).lists
    assert [r["label"] for r in table] == y.tolist() and [r["covered"] for r in table] == [int(a) in s for a, s in zip(y, sets)]
    assert "labelled inputs: coverage" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        predict(directory, "--input", tmp_path / "x.npz", "--out", tmp_path / "s.txt")
    assert exit_info.value.code == 2 and "--out " in capsys.readouterr().err
    numpy.savez(tmp_path / "bad.npz", x=x.numpy(), y=y + 10)
    with pytest.raises(SystemExit):
        predict(directory, "--input", tmp_path / "bad.npz", "--out", tmp_path / "s.parquet")
    assert "'y' must hold class indices in 0..9" in capsys.readouterr().err


@pytest.mark.parametrize("calibration", ["cluster", "rc3p", "risk"])
def test_clustered_rc3p_and_risk_controlled_sets_are_the_predictor_s(digits_predictor, tmp_path, capsys, calibration):
    _, predictor, x = digits_predictor
    data = load_splits("digits", seed=0)
    cal_x, cal_y = data.cal.source.inputs[data.cal.ids], data.cal.labels
    mine = predictor.control_risk(cal_x, cal_y, {"3": 1.0, 8: 0.5}, 0.05, example_ids=data.cal.ids)
    directory = mine.save(tmp_path / "predictor")
    numpy.savez(tmp_path / "x.npz", x=x.numpy(), ids=numpy.arange(700, 750))
    out = tmp_path / "sets.parquet"
    assert predict(directory, "--input", tmp_path / "x.npz", "--out", out, "--score", "aps", "--calibration", calibration) == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["set"] for r in rows] == mine.predict_sets(x, "aps", calibration=calibration, example_ids=torch.arange(700, 750)).lists
    metadata = read_metadata(out)
    assert metadata["calibration"] == calibration and len(metadata["class_thresholds"]) == 10
    assert ("rank_limits" in metadata) == (calibration == "rc3p")
    printed = capsys.readouterr().out
    assert {"cluster": "(clustered: q", "rc3p": "(RC3P: q", "risk": "(risk-controlled: lambda"}[calibration] in printed
    if calibration == "risk":
        assert "expected miss cost <= 0.05" in printed
        with pytest.raises(SystemExit) as exited:
            predict(directory, "--input", tmp_path / "x.npz", "--out", tmp_path / "p.parquet", "--p-values")
        assert exited.value.code == 2 and "p-values are defined for the marginal and class calibrations; risk" in capsys.readouterr().err
