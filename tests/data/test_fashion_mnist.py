"""Fashion-MNIST, read from the files Debian's dataset-fashion-mnist installs (.ci/run installs it;
without it these tests are skipped), and from a generated copy in torchvision's layout (always)."""

import gzip
import struct
from pathlib import Path

import pytest
import torch

from dpsm_ray.cards import load_splits, split_sizes
from dpsm_ray.data.vision import FASHION_MNIST_FILES, load_fashion_mnist

DEBIAN = Path("/usr/share/datasets/fashion-mnist")
needs_debian = pytest.mark.skipif(not (DEBIAN / "train-images-idx3-ubyte.gz").is_file(),
                                  reason="needs Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist; .ci/run installs it)")


def idx(values: torch.Tensor) -> bytes:
    """The IDX encoding of a uint8 tensor (magic 0x08 = uint8, then the dimensions, big-endian)."""
    header = struct.pack(">HBB", 0, 0x08, values.ndim) + b"".join(struct.pack(">I", n) for n in values.shape)
    return header + values.numpy().tobytes()


def write_torchvision_copy(root: Path, train: int = 300, test: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """A small Fashion-MNIST in torchvision's ``FashionMNIST/raw`` layout (uncompressed IDX files)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (train + test, 28, 28), generator=generator, dtype=torch.uint8)
    labels = (torch.arange(train + test) % 10).to(torch.uint8)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    parts = {"train": slice(0, train), "t10k": slice(train, train + test)}
    for name in FASHION_MNIST_FILES:
        split, kind = name.split("-")[0], name.split("-")[1]
        (raw / name).write_bytes(idx((images if kind == "images" else labels)[parts[split]]))
    return images, labels


def test_a_copy_in_torchvision_s_layout_is_split_as_conftr_splits_scaled_down(tmp_path):
    images, labels = write_torchvision_copy(tmp_path)
    data = load_fashion_mnist(tmp_path, seed=0)
    sizes = data.sizes()
    # 55000 / 5000 of the training images, 5000 / 5000 of the test images, in proportion
    assert sizes == {"train": 275, "val": 25, "cal": 50, "test": 50}
    assert data.num_classes == 10 and data.input_shape == (1, 28, 28)
    ids = [getattr(data, name).ids for name in ("train", "val", "cal", "test")]
    assert len(torch.cat(ids).unique()) == sum(sizes.values())
    assert int(max(ids[0].max(), ids[1].max())) < 300 <= int(min(ids[2].min(), ids[3].min()))  # train/val from the training file
    x, y = next(data.train.batches([torch.arange(5)], augment=True, seed=0))  # positions in the split
    expected = (images[data.train.ids[:5]].float()[:, None] / 255 - 0.5) / 0.5  # ConfTr's scaling, no augmentation
    assert torch.equal(y, labels[data.train.ids[:5]].long()) and torch.allclose(x, expected)


def test_a_garbled_or_misshapen_file_is_named(tmp_path):
    for name in FASHION_MNIST_FILES:
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(idx(torch.zeros(2, 28, 28, dtype=torch.uint8) if "images" in name else torch.zeros(3, dtype=torch.uint8))))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: \(2, 28, 28\) images for 3 labels"):
        load_fashion_mnist(tmp_path, seed=0)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b truncated")
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte.gz is not a readable IDX file"):
        load_fashion_mnist(tmp_path, seed=0)


def test_missing_files_name_both_layouts_and_the_debian_package(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Fashion-MNIST not found at .*dataset-fashion-mnist.*--download"):
        load_splits("fashion_mnist", str(tmp_path), seed=0)


@needs_debian
def test_the_debian_files_give_conftr_s_split():
    data = load_splits("fashion_mnist", str(DEBIAN), seed=0)
    assert data.sizes() == split_sizes("fashion_mnist") == {"train": 55000, "val": 5000, "cal": 5000, "test": 5000}
    assert data.num_classes == 10 and data.train.source.inputs.shape == (70000, 1, 28, 28)
    counts = torch.bincount(data.cal.labels, minlength=10)
    assert (counts == 500).all()  # stratified: 500 of each class in 5000


@needs_debian
def test_dpsm_ray_train_runs_on_the_real_files(tmp_path, capsys):
    """The issue's criterion: `dpsm-ray train --dataset fashion_mnist --data-root ...` on the real
    files (a short run: ConfTr's MLP, one epoch on a 3000-image subset)."""
    import pandas as pd

    from dpsm_ray.cli import main

    code = main(["train", "--dataset", "fashion_mnist", "--data-root", str(DEBIAN), "--method", "dpsm", "--alpha", "0.01", "--epochs", "1",
                 "--train-subset", "3000", "--batch-size", "100", "--eval-splits", "3", "--data-workers", "0", "--out", str(tmp_path / "run")])
    assert code == 0
    evals = pd.read_parquet(tmp_path / "run" / "evals.parquet")
    assert set(evals.model) == {"mlp_bn"} and len(evals) == 9 and evals.accuracy.min() > 0.5
    assert (evals.n_cal + evals.n_test == 10000).all()
