"""``dpsm-ray calibrate`` and ``Predictor.from_model``: a model trained elsewhere -- its weights file, or a
``torch.nn.Module`` in Python -- and labelled calibration data in, a predictor out, the same files ``export``
writes, for ``predict`` and ``serve``."""

import json
import re

import numpy
import pytest
import torch

from dpsm_ray.cards import build_model, load_splits
from dpsm_ray.cli import main
from dpsm_ray.predict.predictor import Predictor


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A digits MLP trained by ``dpsm-ray train --out`` for 3 epochs: its predictor is the reference a calibration of
    the same weights on the same split must reproduce."""
    out = tmp_path_factory.mktemp("calibrate") / "run"
    assert main(["train", "--dataset", "digits", "--epochs", "3", "--seed", "0", "--out", str(out)]) == 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    torch.save(state, out.parent / "weights.pt")
    from safetensors.torch import save_file

    save_file(state, str(out.parent / "weights.safetensors"))
    return out


@pytest.mark.parametrize("weights", ["weights.pt", "weights.safetensors"])
def test_calibrating_a_run_s_weights_on_its_calibration_split_gives_the_run_s_predictor(trained_run, tmp_path, capsys, weights):
    reference = Predictor.load(trained_run / "predictor", device="cpu")
    out = tmp_path / "mine"
    assert main(["calibrate", "--model", "mlp", "--weights", str(trained_run.parent / weights), "--dataset", "digits", "--prepare", "card",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    mine = Predictor.load(out, device="cpu")
    assert mine.thresholds == reference.thresholds and mine.alpha == reference.alpha == 0.1
    assert mine.info["test"]["scores"] == reference.info["test"]["scores"]
    assert mine.info["calibration"]["points"] == reference.info["calibration"]["points"] == len(load_splits("digits", seed=0).cal)
    assert mine.info["provenance"]["source"] == "dpsm-ray calibrate" and mine.info["training_config"] is None
    x = load_splits("digits", seed=0).test.source.inputs[:40].numpy()
    for score in ("hps", "aps", "raps"):
        assert mine.predict_sets(x, score).lists == reference.predict_sets(x, score).lists
    assert re.search(r"calibrated on the calibration split of digits \(\d+ points, split seed 0\) at alpha=0.1 \(accuracy there 0.9\d\d\): HPS q ", printed)
    assert "inputs: standardised as the dataset's card prepares them" in printed
    accuracy = mine.info["test"]["accuracy"]
    assert f"accuracy {accuracy:.3f}" in printed and accuracy > 0.5
    # the predictor it wrote answers predict, with labels
    numpy.savez(tmp_path / "x.npz", x=x, y=load_splits("digits", seed=0).test.source.labels[:40].numpy())
    assert main(["predict", str(out), "--input", str(tmp_path / "x.npz"), "--out", str(tmp_path / "sets.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "sets.jsonl").read_text().splitlines()]
    assert [r["set"] for r in rows] == reference.predict_sets(x).lists
    # and serve's answer to POST /predict (dpsm_ray.predict.serving, the replica's code without Ray)
    from dpsm_ray.predict.serving import answer

    status, payload = answer(mine, json.dumps({"inputs": x.tolist()}).encode(), max_batch=4096)
    assert status == 200 and payload["sets"] == reference.predict_sets(x).lists


def test_from_model_in_python_then_recalibrate_equals_the_command(trained_run, tmp_path, capsys):
    data = load_splits("digits", seed=0)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    model.load_state_dict(torch.load(trained_run.parent / "weights.pt", weights_only=True))
    predictor = Predictor.from_model(model, architecture="mlp", dataset="digits", alpha=0.1, device="cpu", prepare="card")
    assert predictor.thresholds == {} and predictor.class_names == Predictor.load(trained_run / "predictor").class_names
    cal_inputs = data.cal.source.inputs[data.cal.ids]
    mine = predictor.recalibrate(cal_inputs, data.cal.labels, example_ids=data.cal.ids)
    assert mine.thresholds == Predictor.load(trained_run / "predictor", device="cpu").thresholds
    mine.save(tmp_path / "p")
    assert Predictor.load(tmp_path / "p", device="cpu").thresholds == mine.thresholds
    with pytest.raises(ValueError, match=r"model: not the network architecture='mlp' builds for 10 classes \(net.5.weight has shape \[3, 128\] where mlp has \[10, 128\]\)"):
        Predictor.from_model(build_model("mlp", 3, input_shape=data.input_shape), architecture="mlp", dataset="digits")


def test_split_all_calibrates_on_every_point_of_a_table_and_a_model_at_chance_is_named(tmp_path, capsys):
    import pandas as pd
    from sklearn.datasets import load_iris

    frame = load_iris(as_frame=True).frame
    frame.to_csv(tmp_path / "iris.csv", index=False)
    torch.manual_seed(0)
    # a model that knows nothing: every logit 0, so every class equally likely for every input
    untrained = {name: torch.zeros_like(tensor) for name, tensor in build_model("mlp", 3, input_shape=(4,)).state_dict().items()}
    torch.save(untrained, tmp_path / "untrained.pt")
    out = tmp_path / "p"
    assert main(["calibrate", "--model", "mlp", "--weights", str(tmp_path / "untrained.pt"), "--dataset",
                 f"table:{tmp_path / 'iris.csv'}:label=target", "--split", "all", "--alpha", "0.2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    predictor = Predictor.load(out, device="cpu")
    assert predictor.info["calibration"]["points"] == len(frame) and predictor.info["test"] is None and predictor.alpha == 0.2
    assert predictor.feature_names == tuple(c for c in frame.columns if c != "target") and predictor.label_column == "target"
    assert "calibrated on every split of table:" in captured.out and "no test" not in captured.out
    # measured on a split it did not calibrate on, the untrained model is at chance, and the command says so
    assert main(["calibrate", "--model", "mlp", "--weights", str(tmp_path / "untrained.pt"), "--dataset",
                 f"table:{tmp_path / 'iris.csv'}:label=target", "--out", str(tmp_path / "q")]) == 0
    assert "warning: this model is at or near chance" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--weights", "{tmp}/absent.pt"], r"--weights .*absent.pt: no such file"),
    (["--alpha", "1.5"], r"--alpha 1.5: must be in the open interval \(0, 1\)"),
    (["--model", "nope"], r"nope"),
    (["--dataset", "table:{tmp}/absent.csv"], r"absent.csv"),
    (["--weights", "{tmp}/garbage.pt"], r"--weights .*garbage.pt: not a state dict"),
])
def test_bad_input_is_one_line_exit_2(trained_run, tmp_path, capsys, argv, message):
    (tmp_path / "garbage.pt").write_bytes(b"not a zip archive")
    base = {"--model": "mlp", "--weights": str(trained_run.parent / "weights.pt"), "--dataset": "digits", "--out": str(tmp_path / "o")}
    for option, value in zip(argv[::2], argv[1::2]):
        base[option] = value.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", *[word for pair in base.items() for word in pair]])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "o" / "predictor.json").exists()


def test_a_predictor_at_chance_is_named_and_a_useful_one_is_not(trained_run):
    from dpsm_ray.predict.export import chance_line

    predictor = Predictor.load(trained_run / "predictor", device="cpu")
    assert chance_line(predictor) is None and predictor.info["test"]["accuracy"] > 0.5
    test = predictor.info["test"]
    every_class = {kind: {"coverage": 1.0, "set_size": 10.0} for kind in test["scores"]}
    assert "every prediction set holds all 10 classes" in chance_line(predictor.with_test(every_class, 50, "d", accuracy=0.9))
    assert "test accuracy 0.140, at most 0.05 above chance (1/10 = 0.100)" in chance_line(predictor.with_test(test["scores"], 50, "d", accuracy=0.14))
    assert chance_line(predictor.with_test(test["scores"], 50, "d", accuracy=0.16)) is None


# -- a model trained in plain PyTorch on a researcher's own table ------------------------------------------

@pytest.fixture(scope="module")
def wine(tmp_path_factory):
    """scikit-learn's wine as a CSV with named cultivars, and an mlp trained in plain PyTorch on the raw
    features of the table's training split (its classes in the table's order: the names sorted), as a
    newcomer would train one: no standardisation."""
    import pandas as pd
    from sklearn.datasets import load_wine

    folder = tmp_path_factory.mktemp("wine")
    frame = load_wine(as_frame=True).frame
    frame["cultivar"] = frame.pop("target").map({0: "barolo", 1: "grignolino", 2: "barbera"})
    frame.to_csv(folder / "wine.csv", index=False)
    dataset = f"table:{folder / 'wine.csv'}:label=cultivar"
    data = load_splits(dataset, seed=0)
    x = data.train.source.inputs[data.train.ids].float()
    torch.manual_seed(0)
    model = build_model("mlp", 3, input_shape=(13,))
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2000):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), data.train.labels).backward()
        optimiser.step()
    torch.save(model.state_dict(), folder / "mlp.pt")
    return folder, dataset, frame, data, model


def test_an_outside_model_is_fed_its_raw_inputs_by_default_and_the_other_preparation_is_warned_at_every_split(wine, tmp_path, capsys):
    folder, dataset, frame, data, model = wine
    test_x = data.test.source.inputs[data.test.ids].float()
    own_accuracy = (model(test_x).argmax(dim=1) == data.test.labels).double().mean().item()
    assert own_accuracy > 0.85  # the model, on its own
    out = tmp_path / "none"
    assert main(["calibrate", "--model", "mlp", "--weights", str(folder / "mlp.pt"), "--dataset", dataset, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "inputs: passed to the model as they are (--prepare none" in captured.out and "warning" not in captured.err
    predictor = Predictor.load(out, device="cpu")
    assert predictor.input_preparation == "none" and predictor.info["input_preparation"]["how"] == "none"
    assert predictor.info["test"]["accuracy"] == pytest.approx(own_accuracy)  # through the predictor, as on its own
    features = frame.drop(columns="cultivar").iloc[data.test.ids.numpy()]
    top1 = predictor.predict_proba(features).argmax(dim=1).numpy()
    assert (numpy.array(predictor.class_names)[top1] == frame.cultivar.iloc[data.test.ids.numpy()].to_numpy()).mean() == pytest.approx(own_accuracy)
    # standardised before the network, as a model dpsm-ray trained takes them: named in one line, at both splits
    for split in ("all", "cal"):
        assert main(["calibrate", "--model", "mlp", "--weights", str(folder / "mlp.pt"), "--dataset", dataset, "--split", split,
                     "--prepare", "card", "--out", str(tmp_path / f"card-{split}")]) == 0
        warned = [line for line in capsys.readouterr().err.splitlines() if "--prepare" in line]
        assert len(warned) == 1 and re.search(r"accuracy on the \d+ calibration points is 0\.\d+ with its inputs standardised as the "
                                              r"dataset's card prepares them \(--prepare card\), but (0\.9\d+|1\.000) with them passed as they are "
                                              r"\(--prepare none\): .* calibrate again with --prepare none", warned[0]), warned
    # in Python, the same choice and the same warning
    python = Predictor.from_model(model, architecture="mlp", dataset=dataset, device="cpu", prepare="card")
    cal = frame.drop(columns="cultivar").iloc[data.cal.ids.numpy()]
    with pytest.warns(UserWarning, match=r"calibrate again with prepare=none"):
        python.recalibrate(cal, frame.cultivar.iloc[data.cal.ids.numpy()])


def test_named_inputs_are_read_by_name_in_any_order_and_arrays_by_position_with_a_warning(wine, tmp_path, capsys):
    import warnings

    import pyarrow

    folder, dataset, frame, data, model = wine
    predictor = Predictor.from_model(model, architecture="mlp", dataset=dataset, device="cpu")
    features = frame.drop(columns="cultivar")
    mine = predictor.recalibrate(features.iloc[data.cal.ids.numpy()], frame.cultivar.iloc[data.cal.ids.numpy()])  # labels by name
    rows = features.iloc[:8]
    expected = mine.predict_sets(rows).lists
    assert len({tuple(s) for s in expected}) > 1  # the wine case: reversed, the old reading gave one class to all 8 rows
    reversed_ = rows[rows.columns[::-1]]
    assert mine.predict_sets(reversed_).lists == expected
    assert mine.predict_sets(pyarrow.Table.from_pandas(reversed_, preserve_index=False)).lists == expected
    assert mine.predict_sets({name: reversed_[name].to_numpy() for name in reversed_}).lists == expected
    assert mine.predict_sets(frame.iloc[:8]).lists == expected  # the label column is left out
    numpy.testing.assert_array_equal(mine.p_values(reversed_), mine.p_values(rows))
    assert mine.evaluate(reversed_, frame.cultivar.iloc[:8]) == mine.evaluate(rows, frame.cultivar.iloc[:8])
    with pytest.raises(ValueError, match=r"missing 1 \('alcohol'\)"):
        mine.predict_sets(reversed_.drop(columns="alcohol"))
    with pytest.raises(ValueError, match=r"unexpected 1 \('colour'\)"):
        mine.predict_sets(reversed_.assign(colour=1.0))
    with pytest.raises(ValueError, match=r"label 'bordeaux' is not a class of this predictor \(barbera, barolo, grignolino\)"):
        mine.recalibrate(rows, ["bordeaux"] * 8)
    # an array is read by position: once per predictor, a warning says in which order
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mine.predict_sets(rows.to_numpy()).lists == expected
        mine.predict_sets(rows.to_numpy())
    assert len(caught) == 1 and "taken by position in that order: pass a DataFrame" in str(caught[0].message)
    # predict with an .npy: a note on stderr
    numpy.save(tmp_path / "rows.npy", reversed_.to_numpy())
    mine.save(tmp_path / "p")
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "p"), "--input", str(tmp_path / "rows.npy"), "--out", str(tmp_path / "sets.csv")]) == 0
    assert "rows.npy is an array: its columns are read by position as this predictor's 13 named features (alcohol, " in capsys.readouterr().err


def test_from_model_refuses_a_network_that_is_not_the_architecture_it_names(wine):
    folder, dataset, frame, data, model = wine
    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(13, 3))  # maps the inputs to 3 logits, but it is not the mlp
    with pytest.raises(ValueError, match=r"model: not the network architecture='mlp' builds for 3 classes \(it lacks net.1.weight"):
        Predictor.from_model(other, architecture="mlp", dataset=dataset)
