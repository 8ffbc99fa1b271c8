"""The paper's three image datasets (Table 4), and Fashion-MNIST, read from their on-disk layouts.

- ``cifar100``: 32x32 images kept as one uint8 tensor (the GPU can hold it) and augmented by
  batched tensor ops (``augment.py``).  The 50000 training images give train / val, the 10000
  test images cal / test.
- ``caltech101``: JPEGs of 101 categories (``BACKGROUND_Google`` is not a class), one pool cut
  into all four splits.
- ``inaturalist``: the 341 species of the kingdom Fungi in iNaturalist 2021.  The paper's sizes
  are exactly that kingdom's ``2021_train_mini`` images (50 a species: 15345 + 1705 = 17050) and
  its ``2021_valid`` images (10 a species: 1410 + 2000 = 3410), so, as for CIFAR-100, the training
  images give train / val and the held-out images cal / test.
- ``fashion_mnist``: Fashion-MNIST (Xiao et al. 2017), the benchmark with published conformal
  training results (ConfTr, Stutz et al. 2022): the original IDX files as Debian's
  ``dataset-fashion-mnist`` installs them (``/usr/share/datasets/fashion-mnist/*.gz``, checked
  against torchvision's md5 sums) or torchvision's ``FashionMNIST/raw/`` layout (``--download``).
  ConfTr's split: 55000 training / 5000 validation images from the 60000 training images; the
  10000 test images give cal / test, 5000 each (ConfTr calibrates on 5000 too, and measures on
  10000: the same expectation, a little more variance here).
- ``inaturalist2018``: the Fungi super-category of iNaturalist 2018 (torchvision's version
  ``2018``, train and val images in one folder tree), cut into all four splits as Caltech-101 is.
  2018 has 321 Fungi species, not the paper's 341, so the class count is read from the data.

The 224-pixel datasets are decoded from files by a ``FileSource`` with the standard ImageNet
transforms.  Every split is stratified and chosen by the run seed; a smaller copy on disk (the
tests' fixtures) gets the paper's sizes scaled to what is there (``fitted_sizes``).  Example ids
index one source per dataset, so ids are unique across the four splits.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch

from dpsm_ray.facts import IMAGE_TITLES, PAPER_SIZES
from dpsm_ray.data.augment import random_crop_flip
from dpsm_ray.data.preprocessing import ImageSpec, InputSpec, spec_transform
from dpsm_ray.data.splits import DataSplits, FileSource, Split, TensorSource, stratified_partition
from dpsm_ray.seeding import derive_seed

# per-channel statistics of the 50000 CIFAR-100 training images
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
_CIFAR_PADDING = 4  # He et al. 2016: pad 4 pixels, crop 32x32
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the statistics torchvision's ImageNet weights expect
IMAGENET_STD = (0.229, 0.224, 0.225)
_IMAGE_SIZE = 224
_RESIZE = 256  # the evaluation transform: shorter side to 256, then the centre 224 x 224
_PIXELS = "8-bit RGB pixel values 0..255 in [C, H, W] order"


def per_channel(values: tuple[float, ...]) -> list:
    """``(a, b, c)`` -> ``[[[a]], [[b]], [[c]]]``: a ``[C, 1, 1]`` list broadcasting over H and W."""
    return [[[value]] for value in values]


CIFAR100_INPUT = InputSpec((3, 32, 32), 255.0, per_channel(CIFAR100_MEAN), per_channel(CIFAR100_STD), _PIXELS, ImageSpec("RGB", 32))
_IMAGENET_INPUT = InputSpec(
    (3, _IMAGE_SIZE, _IMAGE_SIZE), 255.0, per_channel(IMAGENET_MEAN), per_channel(IMAGENET_STD), _PIXELS, ImageSpec("RGB", _RESIZE)
)
_INATURALIST_VERSIONS = ("2021_train_mini", "2021_valid")  # -> train / val, cal / test
_INATURALIST_KINGDOM = "Fungi"
_INATURALIST_2018 = "2018"  # torchvision's folder for train_val2018: <super-category>/<category id>/


def fitted_sizes(sizes: Sequence[int], available: int) -> list[int]:
    """``sizes`` if ``available`` examples hold them all (the rest is left out, so the splits are
    a stratified subset); otherwise the same proportions of ``available``, rounded by largest
    remainder so that every example is used."""
    total = sum(sizes)
    if available >= total:
        return list(sizes)
    floors = [size * available // total for size in sizes]
    remainders = [size * available % total for size in sizes]
    # hand the leftover examples to the largest remainders (ties: the earlier split)
    for position in sorted(range(len(sizes)), key=lambda i: -remainders[i])[: available - sum(floors)]:
        floors[position] += 1
    if min(floors) == 0:
        raise ValueError(f"{available} examples are too few to split in the proportions {list(sizes)}: a split would be empty")
    return floors


def _check_data_root(name: str, data_root: str | Path | None) -> Path:
    if data_root is None:
        raise FileNotFoundError(
            f"dataset {name} is read from files: pass --data-root DIR (and --download to fetch {IMAGE_TITLES[name]} into it)"
        )
    return Path(data_root)


def missing(name: str, path: Path, detail: str = "") -> FileNotFoundError:
    return FileNotFoundError(f"{IMAGE_TITLES[name]} not found at {path}{detail}; pass --download to fetch it into --data-root")


def _non_empty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def check_data_present(name: str, data_root: str | Path | None, download: bool = False) -> Path:
    """Fail fast, naming the expected path and the flag, when dataset ``name`` is not under
    ``data_root`` and may not be downloaded; the loaders call it, and so do the sweep and the CLI
    before any Ray work starts.  Returns the root."""
    root = _check_data_root(name, data_root)
    if download:
        return root
    if name == "cifar100":
        folder = root / "cifar-100-python"
        absent = [file for file in ("train", "test", "meta") if not (folder / file).is_file()]
        if absent:
            raise missing(name, folder, f" (no {', '.join(absent)})")
    elif name == "fashion_mnist":
        _fashion_mnist_files(root)
    elif name == "caltech101":
        if not (root / "caltech101" / "101_ObjectCategories").is_dir():
            raise missing(name, root / "caltech101" / "101_ObjectCategories")
    else:
        for folder in [root / version for version in (_INATURALIST_VERSIONS if name == "inaturalist" else (_INATURALIST_2018,))]:
            if not _non_empty_dir(folder):
                raise missing(name, folder)
    return root


def _two_pool_parts(first: torch.Tensor, second: torch.Tensor, name: str, seed: int) -> list[torch.Tensor]:
    """Train / val from the ``first`` pool of labels, cal / test from the ``second``, whose ids
    follow the first pool's."""
    sizes = PAPER_SIZES[name]
    train, val = stratified_partition(
        first, fitted_sizes([sizes["train"], sizes["val"]], first.numel()), derive_seed(seed, name, "train pool")
    )
    cal, test = stratified_partition(
        second, fitted_sizes([sizes["cal"], sizes["test"]], second.numel()), derive_seed(seed, name, "test pool")
    )
    return [train, val, cal + first.numel(), test + first.numel()]


def check_labels(labels: torch.Tensor, num_classes: int, path: Path) -> None:
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise ValueError(f"labels under {path} must lie in 0..{num_classes - 1}; found {int(labels.min())}..{int(labels.max())}")


def _splits_of(
    name: str, spec: InputSpec, class_names: list[str], source: TensorSource | FileSource, parts: list[torch.Tensor]
) -> DataSplits:
    splits = (Split(split, ids, source) for split, ids in zip(PAPER_SIZES[name], parts))
    return DataSplits(name, len(class_names), spec.shape, *splits, input_spec=spec, class_names=tuple(class_names))


# ----------------------------------------------------------------------------- CIFAR-100


class ArrayUnpickler(pickle.Unpickler):
    """Reads only what the CIFAR-100 python-version files hold -- dicts, lists, bytes and numpy
    arrays -- and refuses any other global, so a planted file cannot run code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}; a CIFAR-100 file holds only arrays, lists and bytes")
        return super().find_class(module, name)


def unpickle(path: Path) -> dict:
    """The CIFAR website's reader, restricted to arrays (``ArrayUnpickler``); the files were pickled
    by Python 2, so keys are bytes."""
    with open(path, "rb") as file:
        try:
            return ArrayUnpickler(file, encoding="bytes").load()
        except pickle.UnpicklingError as error:
            raise ValueError(f"{path} is not a CIFAR-100 file: {error}") from None


def read_cifar100_file(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images ``[N, 3, 32, 32]`` and fine labels from one of the python-version pickles
    (``data``: ``[N, 3072]`` rows, the red, green and blue 32x32 planes in turn)."""
    entry = unpickle(path)
    images = torch.as_tensor(entry[b"data"], dtype=torch.uint8).reshape(-1, 3, 32, 32)
    return images.contiguous(), torch.as_tensor(entry[b"fine_labels"], dtype=torch.int64)


def cifar100_transform(images: torch.Tensor, ids: torch.Tensor, augment: bool, seed: int) -> torch.Tensor:
    """uint8 batch -> normalised float model input; augmented (crop + flip) only in training."""
    if augment:
        images = random_crop_flip(images, ids, seed, _CIFAR_PADDING)
    return CIFAR100_INPUT.apply(images)


def _load_cifar100(data_root: str | Path | None, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """CIFAR-100 from ``<data_root>/cifar-100-python/{train,test,meta}`` (in memory, so
    ``data_workers`` is not used).

    torchvision's ``CIFAR100`` fetches the archive and checks its md5 sums; the arrays are then
    read from the same pickles directly (as torchvision does), which also accepts a small copy
    in that format whose checksums differ.
    """
    root = _check_data_root("cifar100", data_root)
    folder = root / "cifar-100-python"
    if download:
        from torchvision.datasets import CIFAR100

        for train in (True, False):
            CIFAR100(str(root), train=train, download=True)
    check_data_present("cifar100", root)
    train_images, train_labels = read_cifar100_file(folder / "train")
    test_images, test_labels = read_cifar100_file(folder / "test")
    class_names = [name.decode() for name in unpickle(folder / "meta")[b"fine_label_names"]]
    for labels, file in ((train_labels, "train"), (test_labels, "test")):
        check_labels(labels, len(class_names), folder / file)
    source = TensorSource(torch.cat([train_images, test_images]), torch.cat([train_labels, test_labels]), cifar100_transform)
    return _splits_of("cifar100", CIFAR100_INPUT, class_names, source, _two_pool_parts(train_labels, test_labels, "cifar100", seed))


# ----------------------------------------------------------------------------- Fashion-MNIST

FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
# ConfTr's input scaling: (x - 0.5) / 0.5 of the [0, 1] pixels
_FASHION_MNIST_INPUT = InputSpec((1, 28, 28), 255.0, 0.5, 0.5, "8-bit greyscale pixel values 0..255, [1, 28, 28]", ImageSpec("L", 28))


def _fashion_mnist_files(root: Path) -> dict[str, Path]:
    """The four IDX files: ``root/<name>.gz`` (the original distribution, as Debian installs it)
    or torchvision's ``root/FashionMNIST/raw/<name>``; FileNotFoundError naming both otherwise."""
    for candidates in (
        [root / f"{name}.gz" for name in FASHION_MNIST_FILES],
        [root / "FashionMNIST" / "raw" / name for name in FASHION_MNIST_FILES],
    ):
        if all(path.is_file() for path in candidates):
            return dict(zip(FASHION_MNIST_FILES, candidates))
    raise missing(
        "fashion_mnist",
        root,
        f" (neither {root}/train-images-idx3-ubyte.gz ... nor {root}/FashionMNIST/raw/; "
        "Debian: apt-get install dataset-fashion-mnist, then --data-root /usr/share/datasets/fashion-mnist)",
    )


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file, gzipped or not, through torchvision's reader (which takes a path: a gzipped
    one is unpacked to a temporary file first).  Debian recompresses the archives, so their md5
    sums are not upstream's; the loader checks what they hold instead (shapes, labels)."""
    import gzip
    import tempfile
    import zlib

    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    try:
        if path.suffix != ".gz":
            return read_sn3_pascalvincent_tensor(str(path), strict=False)
        with tempfile.NamedTemporaryFile(suffix=".idx") as unpacked:
            unpacked.write(gzip.decompress(path.read_bytes()))
            unpacked.flush()
            return read_sn3_pascalvincent_tensor(unpacked.name, strict=False)
    except (OSError, EOFError, zlib.error, AssertionError, RuntimeError) as error:
        raise ValueError(f"{path} is not a readable IDX file ({type(error).__name__}: {str(error)[:120]})") from None


def load_fashion_mnist(data_root: str | Path | None, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """Fashion-MNIST (module docstring) in memory, so ``data_workers`` is not used."""
    root = _check_data_root("fashion_mnist", data_root)
    if download and not any(
        path.is_file() for path in (root / "train-images-idx3-ubyte.gz", root / "FashionMNIST" / "raw" / "train-images-idx3-ubyte")
    ):
        from torchvision.datasets import FashionMNIST

        for train in (True, False):
            FashionMNIST(str(root), train=train, download=True)
    files = _fashion_mnist_files(root)
    images = {split: read_idx(files[f"{split}-images-idx3-ubyte"]) for split in ("train", "t10k")}
    labels = {split: read_idx(files[f"{split}-labels-idx1-ubyte"]).long() for split in ("train", "t10k")}
    for split in ("train", "t10k"):
        if images[split].ndim != 3 or tuple(images[split].shape[1:]) != (28, 28) or images[split].shape[0] != labels[split].numel():
            raise ValueError(
                f"{files[f'{split}-images-idx3-ubyte']}: {tuple(images[split].shape)} images for {labels[split].numel()} labels; "
                "Fashion-MNIST has 28x28 images, one label each"
            )
        check_labels(labels[split], len(_FASHION_MNIST_CLASSES), files[f"{split}-labels-idx1-ubyte"])
    source = TensorSource(
        torch.cat([images["train"], images["t10k"]])[:, None].contiguous(),
        torch.cat([labels["train"], labels["t10k"]]),
        functools.partial(spec_transform, spec=_FASHION_MNIST_INPUT),  # ConfTr's scaled input, no augmentation (ConfTr uses none)
    )
    return _splits_of(
        "fashion_mnist",
        _FASHION_MNIST_INPUT,
        list(_FASHION_MNIST_CLASSES),
        source,
        _two_pool_parts(labels["train"], labels["t10k"], "fashion_mnist", seed),
    )


# ----------------------------------------------------------------------------- 224-pixel datasets


def _to_rgb(image):
    """Some Caltech-101 and iNaturalist images are grayscale; every model expects 3 channels."""
    return image.convert("RGB")


def _imagenet_transforms():
    """(train, eval) transforms of PIL images: the standard ImageNet recipe at 224 pixels."""
    from torchvision import transforms

    # a module-level function, unlike a lambda, survives pickling into DataLoader workers
    tensor = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train = transforms.Compose(
        [transforms.Lambda(_to_rgb), transforms.RandomResizedCrop(_IMAGE_SIZE), transforms.RandomHorizontalFlip(), *tensor]
    )
    # what IMAGENET_INPUT describes (ToTensor divides by 255, Normalize standardises per channel)
    evaluate = transforms.Compose([transforms.Lambda(_to_rgb), transforms.Resize(_RESIZE), transforms.CenterCrop(_IMAGE_SIZE), *tensor])
    return train, evaluate


def _load_caltech101(data_root: str | Path | None, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """Caltech-101 from ``<data_root>/caltech101/101_ObjectCategories/<category>/image_NNNN.jpg``
    (torchvision's ``Caltech101``: sorted categories without ``BACKGROUND_Google``)."""
    root = check_data_present("caltech101", data_root, download)
    from torchvision.datasets import Caltech101

    dataset = Caltech101(str(root), target_type="category", download=download)
    labels = torch.tensor(dataset.y, dtype=torch.int64)
    parts = stratified_partition(
        labels, fitted_sizes(list(PAPER_SIZES["caltech101"].values()), labels.numel()), derive_seed(seed, "caltech101")
    )
    source = FileSource(dataset, labels, *_imagenet_transforms(), num_workers=data_workers)
    return _splits_of("caltech101", _IMAGENET_INPUT, dataset.categories, source, parts)


def _fungi_species(dataset) -> list[int]:
    """Category ids of the Fungi species in a torchvision ``INaturalist`` 2021 dataset, whose
    folders are named ``<id>_<kingdom>_<phylum>_<class>_<order>_<family>_<genus>_<species>``."""
    kingdom = dataset.categories_index["kingdom"].get(_INATURALIST_KINGDOM)
    if kingdom is None:
        raise ValueError(
            f"no {_INATURALIST_KINGDOM} species under {dataset.root}: its folders name the kingdoms"
            f" {', '.join(dataset.categories_index['kingdom'])}"
        )
    return [category for category, taxa in enumerate(dataset.categories_map) if taxa["kingdom"] == kingdom]


def _load_inaturalist(data_root: str | Path | None, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """The Fungi of iNaturalist 2021 from ``<data_root>/2021_train_mini`` and
    ``<data_root>/2021_valid`` (torchvision's ``INaturalist`` layout), labelled ``0 .. K-1`` in
    the order of their folders."""
    root = check_data_present("inaturalist", data_root, download)
    from torchvision.datasets import INaturalist

    pools = [INaturalist(str(root), version=version, target_type="full", download=download) for version in _INATURALIST_VERSIONS]
    fungi = [_fungi_species(pool) for pool in pools]
    species = [[pool.all_categories[category] for category in categories] for pool, categories in zip(pools, fungi)]
    if species[0] != species[1]:
        raise ValueError(
            f"{root / _INATURALIST_VERSIONS[0]} and {root / _INATURALIST_VERSIONS[1]} hold different {_INATURALIST_KINGDOM} species"
            f" ({len(species[0])} and {len(species[1])} folders)"
        )
    pool_labels = []
    for pool, categories in zip(pools, fungi):
        label_of = {category: label for label, category in enumerate(categories)}
        # Keep only the Fungi images, in a fixed order (torchvision lists files in directory
        # order, which differs between file systems); a short index also pickles cheaply into
        # DataLoader workers.
        pool.index = sorted(entry for entry in pool.index if entry[0] in label_of)
        pool_labels.append(torch.tensor([label_of[category] for category, _ in pool.index], dtype=torch.int64))
    dataset = torch.utils.data.ConcatDataset(pools)
    source = FileSource(dataset, torch.cat(pool_labels), *_imagenet_transforms(), num_workers=data_workers)
    return _splits_of("inaturalist", _IMAGENET_INPUT, species[0], source, _two_pool_parts(*pool_labels, "inaturalist", seed))


def _load_inaturalist2018(data_root: str | Path | None, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """The Fungi super-category of iNaturalist 2018 from ``<data_root>/2018/Fungi/<category id>/``
    (torchvision's ``INaturalist`` version ``2018``), labelled ``0 .. K-1`` in category-id order.
    The archive holds the competition's train and val images in one tree, so, as for
    Caltech-101, one pool is cut into all four splits in the paper's sizes (or their proportions
    when the pool is smaller)."""
    root = check_data_present("inaturalist2018", data_root, download)
    folder = root / _INATURALIST_2018
    from torchvision.datasets import INaturalist

    dataset = INaturalist(str(root), version=_INATURALIST_2018, target_type="full", download=download)
    fungi = dataset.categories_index["super"].get(_INATURALIST_KINGDOM)
    if fungi is None:
        held = ", ".join(dataset.categories_index["super"])
        raise ValueError(f"no {_INATURALIST_KINGDOM} super-category under {folder}: it holds {held}")
    species = [category for category, taxa in enumerate(dataset.categories_map) if taxa["super"] == fungi]
    label_of = {category: label for label, category in enumerate(species)}
    dataset.index = sorted(entry for entry in dataset.index if entry[0] in label_of)  # as in load_inaturalist
    labels = torch.tensor([label_of[category] for category, _ in dataset.index], dtype=torch.int64)
    parts = stratified_partition(
        labels, fitted_sizes(list(PAPER_SIZES["inaturalist2018"].values()), labels.numel()), derive_seed(seed, "inaturalist2018")
    )
    source = FileSource(dataset, labels, *_imagenet_transforms(), num_workers=data_workers)
    return _splits_of("inaturalist2018", _IMAGENET_INPUT, [dataset.all_categories[category] for category in species], source, parts)


LOADERS = {
    "cifar100": _load_cifar100, "caltech101": _load_caltech101, "inaturalist": _load_inaturalist, "inaturalist2018": _load_inaturalist2018,
    "fashion_mnist": load_fashion_mnist,
}
