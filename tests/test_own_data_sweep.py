"""A researcher's own data through the whole service, without code: real Fashion-MNIST written as a
PNG folder tree swept with ``--dataset folder:PATH`` by the sweep script, its predictor exported and
applied by ``dpsm-ray predict`` to a folder of new images (the same sets as the predictor in Python); and
scikit-learn's digits as a Parquet table with named labels, whose names reach the class rows and
the report."""

import gzip
import runpy
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from dpsm_ray import Predictor
from dpsm_ray.own_data import folder_files, parse_folder, readings_record
from dpsm_ray.cli import main as dpsm_ray
from dpsm_ray.data.folder import cache_path
from dpsm_ray.files import sha256_file
from dpsm_ray.storage.layout import read_sweep_settings
from dpsm_ray.sweep.cli import main as sweep_script

pytestmark = pytest.mark.ray

FASHION = Path("/usr/share/datasets/fashion-mnist")
NAMES = ("tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")
SMALL = ["--trials", "1", "--final-seeds", "1", "--epochs", "2", "--base-epochs", "2", "--methods", "ce,dpsm"]


def read_idx(path: Path) -> np.ndarray:
    with gzip.open(path) as handle:
        data = handle.read()
    shape = struct.unpack(">" + "I" * data[3], data[4 : 4 + 4 * data[3]])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)


def run_script(argv: list[str]) -> None:
    defaults = runpy.run_path(str(Path(__file__).parents[1] / "sweeps" / "digits.py"), run_name="the_script")["DEFAULTS"]
    with pytest.raises(SystemExit) as ended:
        raise SystemExit(sweep_script("digits", "a sweep", defaults, argv))
    assert ended.value.code in (0, None)


@pytest.mark.skipif(not (FASHION / "t10k-images-idx3-ubyte.gz").is_file(), reason="Debian's dataset-fashion-mnist is not installed")
def test_an_image_folder_sweeps_and_its_predictor_reads_new_images_as_python_does(ray_session, tmp_path):
    # the decoded images are cached where the driver and its trials both look ($DPSM_RAY_CACHE as
    # the Ray workers inherited it); the test's cache files are removed at the end
    images, labels = read_idx(FASHION / "t10k-images-idx3-ubyte.gz"), read_idx(FASHION / "t10k-labels-idx1-ubyte.gz")
    for i in range(2000):
        (tmp_path / "fm" / NAMES[labels[i]]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).save(tmp_path / "fm" / NAMES[labels[i]] / f"{i}.png")
    (tmp_path / "new").mkdir()
    for i in range(2000, 2040):
        Image.fromarray(images[i]).save(tmp_path / "new" / f"{i}.png")

    results, spec = tmp_path / "sweep", f"folder:{tmp_path / 'fm'}:size=28"
    try:
        run_script(["--dataset", spec, "--model", "cnn", *SMALL, "--results-dir", str(results)])
    finally:  # the decoded images and the listing's verdicts
        path, options = parse_folder(spec)
        files = folder_files(path, 0)[1]
        cache_path(path, options, files).unlink(missing_ok=True)
        readings_record(Path(path), [Path(path) / rel for entries in files.values() for _, rel in entries]).unlink(missing_ok=True)
    classes = pd.read_parquet(results / "classes.parquet")
    assert dict(zip(classes.label, classes.class_name)) == dict(enumerate(sorted(NAMES)))  # ImageFolder's order: the names sorted

    predictor_dir = tmp_path / "exported"
    assert dpsm_ray(["export", str(results), "--method", "dpsm", "--out", str(predictor_dir)]) == 0
    for score in ("hps", "aps"):
        out = tmp_path / f"{score}.parquet"
        assert dpsm_ray(["predict", str(predictor_dir), "--input", str(tmp_path / "new"), "--score", score, "--out", str(out)]) == 0
        written = pd.read_parquet(out)
        predictor = Predictor.load(predictor_dir, device="cpu")
        files = sorted((tmp_path / "new").iterdir())
        x = np.stack([np.asarray(Image.open(file))[None] for file in files])  # [n, 1, 28, 28] uint8, as the docs say
        sets = predictor.predict_sets(torch.from_numpy(x), score=score)  # ids 0..n-1: the files' order, as predict's
        assert written.input_id.tolist() == [file.name for file in files]
        assert [list(s) for s in written.set] == sets.lists
        assert [list(s) for s in written.set_names] == [[sorted(NAMES)[c] for c in s] for s in sets.lists]


def test_a_table_with_named_labels_sweeps_and_the_names_reach_the_class_rows_and_the_report(ray_session, tmp_path):
    from sklearn.datasets import load_digits

    digits = load_digits()
    words = np.array(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    table = pd.DataFrame(digits.data, columns=[f"pixel{i}" for i in range(64)]).assign(digit=words[digits.target])
    table.to_parquet(tmp_path / "digits.parquet")
    results = tmp_path / "sweep"
    run_script(["--dataset", f"table:{tmp_path / 'digits.parquet'}:label=digit", *SMALL, "--results-dir", str(results)])
    classes = pd.read_parquet(results / "classes.parquet")
    assert dict(zip(classes.label, classes.class_name)) == dict(enumerate(sorted(words)))
    report = (results / "report.md").read_text()
    lowest = next(line for line in report.splitlines() if "Lowest class coverage" in line)
    assert any(f"class '{word}'" in lowest for word in words), lowest
    # new rows in the training table's layout, its label column included: predict leaves the label out
    assert dpsm_ray(["export", str(results), "--method", "dpsm", "--out", str(tmp_path / "exported")]) == 0
    table.iloc[-20:].to_parquet(tmp_path / "new.parquet")
    assert dpsm_ray(["predict", str(tmp_path / "exported"), "--input", str(tmp_path / "new.parquet"), "--out", str(tmp_path / "sets.parquet")]) == 0
    predictor = Predictor.load(tmp_path / "exported", device="cpu")
    expected = predictor.predict_sets(torch.tensor(digits.data[-20:], dtype=torch.float32))
    written = pd.read_parquet(tmp_path / "sets.parquet")
    assert [list(s) for s in written.set] == expected.lists
    assert [list(s) for s in written.set_names] == [[sorted(words)[c] for c in s] for s in expected.lists]
    table.iloc[-20:].to_csv(tmp_path / "new.csv", index=False)  # the same rows as CSV
    assert dpsm_ray(["predict", str(tmp_path / "exported"), "--input", str(tmp_path / "new.csv"), "--out", str(tmp_path / "sets-csv.parquet")]) == 0
    assert [list(s) for s in pd.read_parquet(tmp_path / "sets-csv.parquet").set] == expected.lists

    # export over a predictor already there: refused in one line unless --overwrite
    exported = tmp_path / "exported" / "predictor.json"
    before = exported.read_bytes()
    with pytest.raises(SystemExit) as ended:
        dpsm_ray(["export", str(results), "--method", "ce", "--out", str(tmp_path / "exported")])
    assert ended.value.code == 2 and exported.read_bytes() == before
    assert dpsm_ray(["export", str(results), "--method", "ce", "--out", str(tmp_path / "exported"), "--overwrite"]) == 0
    assert Predictor.load(tmp_path / "exported").info["method"] == "ce"

    # the labels shuffled inside the same file: the same command is refused, naming the file, and the report says so
    assert read_sweep_settings(results)["data"]["sha256"] == sha256_file(tmp_path / "digits.parquet")
    table.assign(digit=table.digit.sample(frac=1, random_state=0).to_numpy()).to_parquet(tmp_path / "digits.parquet")
    with pytest.raises(SystemExit) as ended:
        sweep_script("digits", "a sweep", runpy.run_path(str(Path(__file__).parents[1] / "sweeps" / "digits.py"))["DEFAULTS"],
                     ["--dataset", f"table:{tmp_path / 'digits.parquet'}:label=digit", *SMALL, "--results-dir", str(results)])
    assert ended.value.code == 2
    assert dpsm_ray(["report", str(results)]) == 0
    assert "**Warning:** these results were made from other data" in (results / "report.md").read_text()
