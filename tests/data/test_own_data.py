"""A researcher's own data: ``folder:PATH`` (an image folder tree) and ``table:FILE`` (features and
a label column): the splits, the class names, the decoding cache, the preprocessing a predictor
repeats, and one clear line for every layout or file it cannot use."""

import hashlib
import os
import runpy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from dpsm_ray.cards import build_model, check_data_present, load_splits, split_sizes
from dpsm_ray.cli import main as dpsm_ray
from dpsm_ray.own_data import folder_files
from dpsm_ray.data.preprocessing import read_pixels
from dpsm_ray.sweep.cli import main as sweep_script

DIGITS = runpy.run_path(str(Path(__file__).parents[2] / "sweeps" / "digits.py"))["DEFAULTS"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSM_RAY_CACHE", str(tmp_path / "cache"))
    folder_files.cache_clear()


def write_images(root, per_class: dict[str, int], size=(12, 10), mode="L", seed=0):
    """``per_class[name]`` random images under ``root/name/``; the class's mean brightness is its
    index (so the classes differ)."""
    rng = np.random.default_rng(seed)
    for index, (name, count) in enumerate(per_class.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
            pixels = np.clip(rng.normal(40 * index + 20, 10, shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode).save(root / name / f"{i}.png")


def test_a_folder_tree_is_split_stratified_with_its_folder_names_as_classes(tmp_path):
    write_images(tmp_path / "pics", {"cat": 20, "dog": 30, "owl": 10})
    spec = f"folder:{tmp_path / 'pics'}:size=8"
    assert split_sizes(spec) == {"train": 30, "val": 9, "cal": 9, "test": 12}  # 60 images at 0.15, 0.15, 0.2
    data = load_splits(spec, seed=3)
    assert data.class_names == ("cat", "dog", "owl") and data.num_classes == 3 and data.input_shape == (1, 8, 8)
    ids = torch.cat([data.train.ids, data.val.ids, data.cal.ids, data.test.ids])
    assert ids.unique().numel() == 60 and data.sizes() == split_sizes(spec)
    # stratified: each class's share of the training split within one image of its share of all
    counts = torch.bincount(data.train.labels, minlength=3).tolist()
    assert all(abs(c - 30 * n / 60) <= 1 for c, n in zip(counts, (20, 30, 10)))
    assert not torch.equal(load_splits(spec, seed=4).train.ids, data.train.ids)  # the seed draws the split
    # the raw inputs are the pixels a predictor reads from the same file (resized, centre-cropped)
    first = data.train.ids[0]
    files = [rel for _, rel in folder_files(str(tmp_path / "pics"), 0)[1][""]]  # the images in id order
    assert np.array_equal(data.train.source.inputs[first].numpy(), read_pixels(tmp_path / "pics" / files[first], "L", 8, (8, 8)))
    # standardised per channel by the training split's pixels
    train = data.train.source.inputs[data.train.ids].double() / 255
    assert data.input_spec.mean == [[[pytest.approx(float(train.mean()))]]] and data.input_spec.image.resize == 8


def test_a_presplit_folder_keeps_its_own_splits_and_rgb_wins_over_greyscale(tmp_path, capsys):
    for split, count in (("train", 6), ("val", 2), ("cal", 3), ("test", 4)):
        write_images(tmp_path / "pics" / split, {"a": count, "b": count}, seed=len(split))
    write_images(tmp_path / "pics" / "test", {"a": 1}, mode="RGB", size=(20, 14), seed=9)  # overwrites test/a/0.png in colour
    spec = f"folder:{tmp_path / 'pics'}:size=8"
    assert split_sizes(spec) == {"train": 12, "val": 4, "cal": 6, "test": 8}
    check_data_present(spec)  # the driver: decodes once into the cache
    said = capsys.readouterr().err
    assert "decoding 30 images of 2 classes once" in said and "modes L, RGB" in said and "each converted to RGB" in said
    assert f"some images are greyscale: folder:{tmp_path / 'pics'}:channels=1 makes every image greyscale instead" in said
    data = load_splits(spec, seed=0)
    assert capsys.readouterr().err == ""  # the trial's load reads the cache
    assert data.input_shape == (3, 8, 8) and data.sizes() == {"train": 12, "val": 4, "cal": 6, "test": 8}
    assert data.test.labels.tolist() == [0] * 4 + [1] * 4


def test_an_unusable_folder_is_named_in_one_line(tmp_path):
    def error(spec):
        with pytest.raises((ValueError, FileNotFoundError)) as raised:
            check_data_present(spec)
        folder_files.cache_clear()
        return str(raised.value)

    root = tmp_path / "pics"
    assert "no such folder" in error(f"folder:{root}")
    root.mkdir()
    assert "no class folder with images under it" in error(f"folder:{root}")
    write_images(root, {"a": 5})
    assert "one class (a); a classifier needs at least 2" in error(f"folder:{root}")
    write_images(root, {"a": 5, "b": 3})
    assert "class 'b' has 3 images; each class needs at least 4" in error(f"folder:{root}")
    write_images(root, {"a": 5, "b": 5})
    (root / "notes.txt").write_text("x")
    assert f"{root / 'notes.txt'} is not in a class folder" in error(f"folder:{root}")
    (root / "notes.txt").unlink()
    (root / "a" / "notes.txt").write_text("x")
    assert f"{root / 'a' / 'notes.txt'} is not an image" in error(f"folder:{root}") and "skip=1" in error(f"folder:{root}")
    (root / "a" / "notes.txt").unlink()
    (root / "a" / "broken.png").write_bytes(b"not a png")
    assert f"{root / 'a' / 'broken.png'} cannot be read as an image" in error(f"folder:{root}") and "skip=1" in error(f"folder:{root}")
    (root / "a" / "notes.txt").write_text("x")
    check_data_present(f"folder:{root}:skip=1")  # both left out
    assert load_splits(f"folder:{root}:skip=1", seed=0).sizes() == {"train": 4, "val": 2, "cal": 2, "test": 2}  # 10 images
    (root / "a" / "broken.png").unlink()
    (root / "train").mkdir()
    assert "has train/ but not val/, cal/, test/" in error(f"folder:{root}")
    assert "val, cal and test must be fractions in (0, 1) summing to less than 1" in error(f"folder:{root}:val=0.5,cal=0.3,test=0.3")
    assert "unknown folder option 'colour'" in error(f"folder:{root}:colour=1")
    assert "folder needs size >= 8, channels 0 (from the images), 1 or 3" in error(f"folder:{root}:channels=2")


def test_a_table_of_features_with_named_labels(tmp_path):
    rng = np.random.default_rng(0)
    names = np.array(["setosa", "versicolor", "virginica"])[np.arange(90) % 3]
    frame = pd.DataFrame({"f1": rng.normal(size=90), "f2": rng.normal(size=90), "species": names})
    frame.to_parquet(tmp_path / "iris.parquet")
    frame.to_csv(tmp_path / "iris.csv", index=False)
    for file in ("iris.parquet", "iris.csv"):
        spec = f"table:{tmp_path / file}:label=species,val=0.2,cal=0.2,test=0.2"
        assert split_sizes(spec) == {"train": 36, "val": 18, "cal": 18, "test": 18}
        data = load_splits(spec, seed=0)
        assert data.class_names == ("setosa", "versicolor", "virginica") and data.input_shape == (2,)
        rows = torch.cat([data.train.ids, data.val.ids, data.cal.ids, data.test.ids])
        assert torch.equal(data.train.source.labels[rows], torch.tensor(pd.Categorical(names).codes[rows.numpy()], dtype=torch.int64))
        assert torch.allclose(data.train.source.inputs, torch.tensor(frame[["f1", "f2"]].to_numpy(), dtype=torch.float32))
    np.savez(tmp_path / "emb.npz", embeddings=rng.normal(size=(40, 5)).astype(np.float32), label=np.arange(40) % 4)
    data = load_splits(f"table:{tmp_path / 'emb.npz'}", seed=0)
    assert data.class_names == ("0", "1", "2", "3") and data.input_shape == (5,)


def test_an_unusable_table_is_named_in_one_line(tmp_path):
    def error(frame, spec_tail=""):
        frame.to_parquet(tmp_path / "t.parquet")
        with pytest.raises((ValueError, FileNotFoundError)) as raised:
            split_sizes(f"table:{tmp_path / 't.parquet'}{spec_tail}")
        return str(raised.value)

    good = {"x": np.arange(20.0), "label": np.arange(20) % 2}
    assert "no label column 'label'; its 2 columns: x, y; name the label column with label=NAME (table:" in error(
        pd.DataFrame({"x": good["x"], "y": good["label"]}))
    wide = pd.DataFrame({**{f"f{i}": good["x"] for i in range(20)}, "species": good["label"]})
    assert "its 21 columns: f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, ..., species; name" in error(wide)  # the last one shown
    assert "1 rows have no label in column 'label' (the first: row 4, counting from 0 after the header)" in error(
        pd.DataFrame({**good, "label": np.where(np.arange(20) == 4, None, "a")}))
    pd.DataFrame({"x": good["x"], "label": good["label"]}).to_csv(tmp_path / "semi.csv", sep=";", index=False)
    with pytest.raises(ValueError, match=r"its header reads as one column, 'x;label': the file looks separated by semicolons"):
        split_sizes(f"table:{tmp_path / 'semi.csv'}")
    with pytest.raises(ValueError, match=r"dataset folder:.*semi.csv is a file, not a folder; .* or a table of features as table:FILE"):
        split_sizes(f"folder:{tmp_path / 'semi.csv'}")
    assert "column 'word' is " in (said := error(pd.DataFrame({**good, "word": ["a"] * 20}))) and "not a number" in said
    assert "1 rows have a missing or infinite feature (the first: row 3, column 'x')" in error(pd.DataFrame({**good, "x": np.where(np.arange(20) == 3, np.nan, 1.0)}))
    assert "labels 'label' must be integers or names; got fractions" in error(pd.DataFrame({**good, "label": np.arange(20) / 3}))
    assert "hold one class" in error(pd.DataFrame({**good, "label": np.zeros(20, int)}))
    assert "20 examples are too few" not in error(pd.DataFrame({**good, "label": np.zeros(20, int)}))
    with pytest.raises(ValueError, match="3 examples are too few to split"):
        pd.DataFrame({"x": [1.0, 2, 3], "label": [0, 1, 0]}).to_parquet(tmp_path / "small.parquet")
        split_sizes(f"table:{tmp_path / 'small.parquet'}")
    assert "the table has no rows; it needs one row per example" in error(pd.DataFrame({"x": np.zeros(0), "label": np.zeros(0, int)}))
    np.savez(tmp_path / "empty.npz", embeddings=np.zeros((0, 3)), label=np.zeros(0, int))
    with pytest.raises(ValueError, match="the table has no rows"):
        split_sizes(f"table:{tmp_path / 'empty.npz'}")
    with pytest.raises(FileNotFoundError, match="no such file"):
        split_sizes(f"table:{tmp_path / 'absent.csv'}")
    with pytest.raises(ValueError, match=r"give a \.parquet, \.csv, \.npz file"):
        split_sizes(f"table:{tmp_path / 'data.json'}")


def test_data_that_changes_under_the_same_name_gets_a_new_base_model_and_a_new_decoding(tmp_path):
    import os

    from dpsm_ray.data.folder import cache_path
    from dpsm_ray.train.base_model import cache_entry
    from dpsm_ray.config import TrainConfig

    write_images(tmp_path / "pics", {"a": 6, "b": 6})
    spec = f"folder:{tmp_path / 'pics'}"
    config = TrainConfig(dataset=spec, model="cnn", init="base", batch_size=4, base_batch_size=4)
    entry, decoded_at = cache_entry(config), cache_path(str(tmp_path / "pics"), {"size": 32, "channels": 0}, folder_files(str(tmp_path / "pics"), 0)[1])
    assert entry == cache_entry(config) and entry.name.startswith("folder-cnn-seed0-")
    write_images(tmp_path / "pics", {"a": 1}, seed=5)  # a.0.png rewritten with other pixels
    os.utime(tmp_path / "pics" / "a" / "0.png", ns=(1, 1))  # a different modification time, whatever the clock
    folder_files.cache_clear()
    assert cache_entry(config) != entry
    assert cache_path(str(tmp_path / "pics"), {"size": 32, "channels": 0}, folder_files(str(tmp_path / "pics"), 0)[1]) != decoded_at
    assert "-" not in cache_entry(TrainConfig(dataset="digits", init="base")).name.rpartition("seed0-")[2]  # built-in data: the config alone


def truncate(file: Path) -> None:
    """Cut the second half of ``file``'s bytes, as an interrupted copy does: its header still reads."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def one_line(capsys, command) -> str:
    """``command``'s exit, which must be status 2 with one line on stderr: that line."""
    with pytest.raises(SystemExit) as ended:
        command()
    said = capsys.readouterr().err
    assert ended.value.code == 2 and said.count("\n") == 1 and said.endswith("\n"), said
    folder_files.cache_clear()
    return said


def test_a_missing_path_a_truncated_image_and_a_table_with_no_rows_are_one_line_exit_2_before_anything_runs(tmp_path, capsys, monkeypatch):
    def train(spec):
        return one_line(capsys, lambda: dpsm_ray(["train", "--dataset", spec, "--epochs", "1", "--batch-size", "4"]))

    def sweep(spec):
        argv = ["--dataset", spec, "--batch-size", "4", "--results-dir", str(tmp_path / "sweep")]
        return one_line(capsys, lambda: sweep_script("digits", "a sweep", DIGITS, argv))

    absent = tmp_path / "absent"
    for said in (train(f"folder:{absent}"), sweep(f"folder:{absent}")):
        assert f"dataset folder:{absent}: no such folder; give the folder that holds a folder of images for each class" in said
    monkeypatch.chdir(tmp_path)
    assert f"folder:absent: no such folder (relative to the current directory {tmp_path})" in train("folder:absent")

    write_images(tmp_path / "pics", {"a": 6, "b": 6})
    truncate(tmp_path / "pics" / "b" / "3.png")
    for said in (train(f"folder:{tmp_path / 'pics'}"), sweep(f"folder:{tmp_path / 'pics'}")):
        assert f"{tmp_path / 'pics' / 'b' / '3.png'} cannot be decoded, a truncated or corrupt image (image file is truncated)" in said
        assert f"remove or replace it, or add the option skip=1 (folder:{tmp_path / 'pics'}:skip=1)" in said

    (tmp_path / "header.csv").write_text("x,y,label\n")
    for said in (train(f"table:{tmp_path / 'header.csv'}"), sweep(f"table:{tmp_path / 'header.csv'}")):
        assert f"dataset table:{tmp_path / 'header.csv'}: the table has no rows; it needs one row per example" in said
    assert f"dataset table:{tmp_path / 'absent.csv'}: no such file; give a .parquet, .csv, .npz file" in train(f"table:{tmp_path / 'absent.csv'}")
    assert not (tmp_path / "sweep").exists()  # refused before the results directory is made


def test_skip_leaves_out_truncated_images_too_and_says_how_many(tmp_path, capsys):
    write_images(tmp_path / "pics", {"a": 6, "b": 6})
    photo = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(photo).save(tmp_path / "pics" / "b" / "photo.jpg")
    truncate(tmp_path / "pics" / "a" / "2.png")
    truncate(tmp_path / "pics" / "b" / "photo.jpg")  # a JPEG is checked at a reduced scale: its truncation still shows
    with pytest.raises(ValueError, match=r"a/2\.png cannot be decoded, a truncated or corrupt image"):
        check_data_present(f"folder:{tmp_path / 'pics'}")
    folder_files.cache_clear()
    (tmp_path / "pics" / "a" / "2.png").unlink()
    with pytest.raises(ValueError, match=r"b/photo\.jpg cannot be decoded, a truncated or corrupt image \(image file is truncated"):
        check_data_present(f"folder:{tmp_path / 'pics'}")
    truncate(tmp_path / "pics" / "a" / "4.png")
    folder_files.cache_clear()

    spec = f"folder:{tmp_path / 'pics'}:size=8,skip=1"
    assert sum(split_sizes(spec).values()) == 10  # 13 files, one removed, two truncated
    check_data_present(spec)
    said = capsys.readouterr().err
    assert f"decoding 10 images of 2 classes once" in said
    assert f"; 2 files that are not readable images (the first: {tmp_path / 'pics' / 'a' / '4.png'}) left out (skip=1)" in said
    data = load_splits(spec, seed=0)
    assert data.sizes() == {"train": 4, "val": 2, "cal": 2, "test": 2} and data.train.source.inputs.shape == (10, 1, 8, 8)


def test_each_image_is_decoded_once_and_its_verdict_kept_until_the_file_changes(tmp_path, monkeypatch):
    from PIL import Image as pil

    write_images(tmp_path / "pics", {"a": 5, "b": 5})
    listing = folder_files(str(tmp_path / "pics"), 0)
    folder_files.cache_clear()  # as a trial's process starts: it reads the verdicts, opens no image
    opened = []
    real_open = pil.open
    monkeypatch.setattr(pil, "open", lambda *args, **kwargs: opened.append(args[0]) or real_open(*args, **kwargs))
    assert folder_files(str(tmp_path / "pics"), 0) == listing and opened == []
    folder_files.cache_clear()
    truncate(tmp_path / "pics" / "b" / "1.png")
    os.utime(tmp_path / "pics" / "b" / "1.png", ns=(1, 1))  # changed: another size and modification time, whatever the clock
    with pytest.raises(ValueError, match=r"b/1\.png cannot be decoded"):
        folder_files(str(tmp_path / "pics"), 0)
    assert len(opened) == 10  # decoded again, every file, once


def test_a_greyscale_folder_goes_to_an_rgb_model_as_three_equal_channels_on_its_own_or_with_channels_3(tmp_path):
    write_images(tmp_path / "pics", {"a": 6, "b": 6, "c": 6})
    grey = load_splits(f"folder:{tmp_path / 'pics'}:size=8", seed=0)
    rgb = load_splits(f"folder:{tmp_path / 'pics'}:size=8,channels=3", seed=0)
    assert grey.input_shape == (1, 8, 8) and rgb.input_shape == (3, 8, 8) and torch.equal(grey.train.ids, rgb.train.ids)
    # PIL's L -> RGB repeats the grey value: the three channels are the greyscale image, so are their statistics
    assert torch.equal(rgb.train.source.inputs, grey.train.source.inputs.expand(-1, 3, -1, -1))
    assert rgb.input_spec.mean == [[[grey.input_spec.mean[0][0][0]]]] * 3 and rgb.input_spec.image.mode == "RGB"
    # an RGB network built for the greyscale data sees exactly the channels=3 inputs, with the RGB architecture's weights
    torch.manual_seed(0)
    on_grey = build_model("torchvision:resnet18", 3, input_shape=grey.input_shape).eval()
    on_rgb = build_model("torchvision:resnet18", 3, input_shape=rgb.input_shape).eval()
    on_rgb.load_state_dict(on_grey.state_dict())
    (x_grey, _), (x_rgb, _) = (next(d.train.source.batches([d.train.ids[:4]], augment=False, seed=0)) for d in (grey, rgb))
    assert torch.equal(x_grey.expand(-1, 3, -1, -1), x_rgb)
    with torch.no_grad():  # equal up to float rounding: the channels=3 batch is laid out channels-last, so its sums run in another order
        torch.testing.assert_close(on_grey(x_grey), on_rgb(x_rgb), rtol=1e-5, atol=1e-6)
    assert dpsm_ray(["train", "--dataset", f"folder:{tmp_path / 'pics'}:size=8", "--model", "torchvision:resnet18", "--method", "ce",
                     "--epochs", "1", "--batch-size", "4", "--eval-splits", "1"]) == 0


def test_a_data_record_notices_changed_content_and_listings_but_not_a_copy_or_a_touch(tmp_path, monkeypatch):
    import os
    import shutil

    from dpsm_ray import own_data
    from dpsm_ray.own_data import path_record, record_change

    for name in ("cat", "dog"):
        (tmp_path / "d" / name).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "d" / name / f"{i}.png").write_bytes(bytes([i]) * 100)
    before = path_record(str(tmp_path / "d"))
    assert before["kind"] == "folder" and before["files"] == 6 and before["bytes"] == 600
    os.utime(tmp_path / "d" / "cat" / "0.png", (1, 1))  # touched: the same data
    assert record_change(before, path_record(str(tmp_path / "d"))) is None
    shutil.copytree(tmp_path / "d", tmp_path / "copy")  # a copy: the same data at another path
    assert record_change({**before, "path": str(tmp_path / "copy")}, path_record(str(tmp_path / "copy"))) is None
    (tmp_path / "d" / "cat" / "2.png").rename(tmp_path / "d" / "dog" / "9.png")  # a label changed: the listing
    change = record_change(before, path_record(str(tmp_path / "d")))
    assert change.startswith(f"{tmp_path / 'd'}: its files differ (then 6 files, 600 bytes, modified ")
    # a file's content, hashed whole (sha256sum's), or past the limit by its size and 64 chunks of it
    (tmp_path / "t.csv").write_bytes(b"a,b\n1,2\n")
    record = path_record(str(tmp_path / "t.csv"))
    assert record["sha256"] == hashlib.sha256(b"a,b\n1,2\n").hexdigest()
    (tmp_path / "t.csv").write_bytes(b"a,b\n2,1\n")
    assert "t.csv: its content differs" in record_change(record, path_record(str(tmp_path / "t.csv")))
    monkeypatch.setattr(own_data, "FULL_HASH_BYTES", 2**20)
    (tmp_path / "big").write_bytes(bytes(3 * 2**20))
    sampled = path_record(str(tmp_path / "big"))
    with open(tmp_path / "big", "r+b") as handle:  # a byte at the start: inside the first sampled chunk
        handle.write(b"\x01")
    assert record_change(sampled, path_record(str(tmp_path / "big"))) is not None
    (tmp_path / "big").unlink()
    assert record_change(sampled, path_record(str(tmp_path / "big"))) == f"{tmp_path / 'big'} is not there any more"
