import numpy
import pytest
import torch
from fake_datasets import (
    CALTECH_CATEGORIES, CIFAR_TEST, CIFAR_TRAIN, INATURALIST_PER_SPECIES, cifar_labels, fungi_gray, write_caltech101, write_cifar100,
    INATURALIST_2018_PER_SPECIES, write_inaturalist2018, write_inaturalist2021, write_jpeg,
)

from dpsm_ray.cards import check_dataset, load_splits, split_sizes

from dpsm_ray.data import SPLIT_NAMES, fitted_sizes
from dpsm_ray.data.vision import CIFAR100_MEAN, CIFAR100_STD, IMAGENET_MEAN, IMAGENET_STD

PAPER = {
    "cifar100": {"train": 45000, "val": 5000, "cal": 3000, "test": 7000},
    "caltech101": {"train": 4310, "val": 1256, "cal": 1111, "test": 2000},
    "inaturalist": {"train": 15345, "val": 1705, "cal": 1410, "test": 2000},
    "inaturalist2018": {"train": 15345, "val": 1705, "cal": 1410, "test": 2000},
}


# the tiny copies are written once per module: the loaders only read them
@pytest.fixture(scope="module")
def cifar100_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return root, write_cifar100(root)


@pytest.fixture(scope="module")
def caltech101_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_caltech101(root)
    return root


@pytest.fixture(scope="module")
def inaturalist_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_inaturalist2021(root)
    return root


@pytest.fixture(scope="module")
def inaturalist2018_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_inaturalist2018(root)
    return root


def all_ids(data) -> torch.Tensor:
    return torch.cat([getattr(data, split).ids for split in SPLIT_NAMES])


def assert_stratified(split, pool_labels: torch.Tensor, classes: int) -> None:
    """Each class's count in ``split`` is within one of its share of the pool it was cut from."""
    expected = torch.bincount(pool_labels, minlength=classes).double() * len(split) / pool_labels.numel()
    counts = torch.bincount(split.labels, minlength=classes).double()
    assert (counts - expected).abs().max() <= 1.0 + 1e-9


def test_split_sizes_are_the_papers_without_any_data():
    for name, sizes in PAPER.items():
        assert split_sizes(name) == sizes


def test_fitted_sizes_keep_the_papers_subset_or_scale_by_largest_remainder():
    assert fitted_sizes([15345, 1705], 17050) == [15345, 1705]
    assert fitted_sizes([15345, 1705], 90048) == [15345, 1705]  # more images: a subset of the paper's size
    assert fitted_sizes([45000, 5000], 200) == [180, 20]
    # 60 images in 4310:1256:1111:2000 (of 8677): exact shares 29.80, 8.69, 7.68, 13.83; the floors
    # take 57, and the 3 left over go to the largest fractions (test, train, val)
    assert fitted_sizes([4310, 1256, 1111, 2000], 60) == [30, 9, 7, 14]
    with pytest.raises(ValueError, match="3 examples are too few"):
        fitted_sizes([4310, 1256, 1111, 2000], 3)


def test_dataset_names_take_no_options():
    with pytest.raises(ValueError, match="only synthetic, glyphs, fonts, fonts_transfer take options, and folder:PATH, table:PATH a path"):
        check_dataset("cifar100:size=10")


# ----------------------------------------------------------------------------- CIFAR-100


def test_cifar100_splits_are_scaled_disjoint_and_stratified(cifar100_root):
    root, _ = cifar100_root
    data = load_splits("cifar100", str(root), seed=0)
    assert data.sizes() == {"train": 180, "val": 20, "cal": 30, "test": 70}  # 45000:5000 of 200, 3000:7000 of 100
    assert data.num_classes == 100 and data.input_shape == (3, 32, 32)
    ids = all_ids(data)
    assert ids.unique().numel() == ids.numel() == CIFAR_TRAIN + CIFAR_TEST
    # train / val come from the training file, cal / test from the test file (ids after it)
    assert data.train.ids.max() < CIFAR_TRAIN <= data.cal.ids.min() and data.val.ids.max() < CIFAR_TRAIN <= data.test.ids.min()
    train_file, test_file = torch.as_tensor(cifar_labels(CIFAR_TRAIN)), torch.as_tensor(cifar_labels(CIFAR_TEST))
    for split, pool in ((data.train, train_file), (data.val, train_file), (data.cal, test_file), (data.test, test_file)):
        assert_stratified(split, pool, 100)


def test_cifar100_split_is_chosen_by_the_seed(cifar100_root):
    root, _ = cifar100_root
    first, again, other = (load_splits("cifar100", str(root), seed=s) for s in (3, 3, 4))
    assert all(torch.equal(getattr(first, s).ids, getattr(again, s).ids) for s in SPLIT_NAMES)
    assert not torch.equal(first.train.ids, other.train.ids)


def test_cifar100_batches_are_the_pickled_images_normalised(cifar100_root):
    root, images = cifar100_root
    data = load_splits("cifar100", str(root), seed=0)
    positions = torch.arange(5)
    x, y = next(data.test.batches([positions], augment=False, seed=0))
    raw = torch.as_tensor(images["test"])[data.test.ids[positions] - CIFAR_TRAIN]
    assert x.dtype == torch.float32 and x.shape == (5, 3, 32, 32)
    mean, std = torch.tensor(CIFAR100_MEAN)[:, None, None], torch.tensor(CIFAR100_STD)[:, None, None]
    torch.testing.assert_close(x, (raw.float() / 255 - mean) / std)
    assert torch.equal(y, torch.as_tensor(cifar_labels(CIFAR_TEST))[data.test.ids[positions] - CIFAR_TRAIN])
    augmented, y_aug = next(data.test.batches([positions], augment=True, seed=0))
    assert augmented.shape == (5, 3, 32, 32) and torch.equal(y_aug, y) and not torch.equal(augmented, x)


def test_cifar100_stays_uint8_until_a_batch_is_drawn(cifar100_root):
    root, _ = cifar100_root
    source = load_splits("cifar100", str(root), seed=0).train.source
    assert source.inputs.dtype == torch.uint8 and source.inputs.shape == (CIFAR_TRAIN + CIFAR_TEST, 3, 32, 32)


# ----------------------------------------------------------------------------- Caltech-101


def test_caltech101_splits_are_scaled_disjoint_and_stratified(caltech101_root):
    data = load_splits("caltech101", str(caltech101_root), seed=0, data_workers=0)
    assert data.sizes() == {"train": 30, "val": 9, "cal": 7, "test": 14}  # see the fitted_sizes test
    assert data.num_classes == len(CALTECH_CATEGORIES) and data.input_shape == (3, 224, 224)  # BACKGROUND_Google is no class
    ids = all_ids(data)
    assert ids.unique().numel() == ids.numel() == 60
    pool = torch.arange(60) // 12  # torchvision lists category by category, 12 images each
    assert torch.equal(data.train.source.labels, pool)
    for split in SPLIT_NAMES:
        assert_stratified(getattr(data, split), pool, len(CALTECH_CATEGORIES))


@pytest.mark.parametrize("augment", [False, True])
def test_caltech101_batches_are_224_pixel_rgb(caltech101_root, augment):
    data = load_splits("caltech101", str(caltech101_root), seed=0, data_workers=0)
    # ids 0 and 12 are image_0001 of the first two categories: the grayscale ones
    x, y = next(data.train.source.batches([torch.tensor([0, 12, 13, 59])], augment=augment, seed=0))
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32
    assert y.tolist() == [0, 1, 1, 4]
    x, y = next(data.train.batches([torch.arange(4)], augment=augment, seed=0))
    assert x.shape == (4, 3, 224, 224) and 0 <= int(y.min()) and int(y.max()) < data.num_classes


def test_file_augmentation_is_per_example_and_spares_the_global_rng(caltech101_root):
    data = load_splits("caltech101", str(caltech101_root), seed=0, data_workers=0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    batch, _ = next(data.train.batches([torch.tensor([0, 5, 9])], augment=True, seed=7))
    alone, _ = next(data.train.batches([torch.tensor([9])], augment=True, seed=7))
    reordered, _ = next(data.train.batches([torch.tensor([9, 0])], augment=True, seed=7))
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(batch[2], alone[0], rtol=0, atol=0)
    torch.testing.assert_close(batch[0], reordered[1], rtol=0, atol=0)
    other_epoch, _ = next(data.train.batches([torch.tensor([0, 5, 9])], augment=True, seed=8))
    assert not torch.equal(other_epoch, batch)


def test_file_augmentation_does_not_depend_on_the_worker_count(caltech101_root):
    positions = [torch.tensor([0, 5, 9]), torch.tensor([1, 2])]
    batches = {}
    for workers in (0, 2):
        data = load_splits("caltech101", str(caltech101_root), seed=0, data_workers=workers)
        batches[workers] = list(data.train.batches(positions, augment=True, seed=7))
    for (x0, y0), (x2, y2) in zip(batches[0], batches[2]):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


# ----------------------------------------------------------------------------- iNaturalist


def test_inaturalist_keeps_only_the_fungi_labelled_in_folder_order(inaturalist_root):
    data = load_splits("inaturalist", str(inaturalist_root), seed=0, data_workers=0)
    # 3 Fungi species: 30 train_mini images -> 15345:1705 = 27 + 3; 12 valid images -> 1410:2000
    # = 4.96 + 7.04 -> 5 + 7
    assert data.sizes() == {"train": 27, "val": 3, "cal": 5, "test": 7}
    assert data.num_classes == 3 and data.input_shape == (3, 224, 224)
    ids = all_ids(data)
    assert ids.unique().numel() == ids.numel() == 3 * sum(INATURALIST_PER_SPECIES.values())
    assert data.train.ids.max() < 30 <= data.cal.ids.min()
    std, mean = torch.tensor(IMAGENET_STD)[:, None, None], torch.tensor(IMAGENET_MEAN)[:, None, None]
    for split in SPLIT_NAMES:
        part = getattr(data, split)
        x, y = next(part.batches([torch.arange(len(part))], augment=False, seed=0))
        assert x.shape == (len(part), 3, 224, 224)
        # every image is a flat gray that encodes its species: no other kingdom, right labels
        gray = ((x * std + mean) * 255).mean(dim=(1, 2, 3))
        expected = torch.tensor([fungi_gray(int(label)) for label in y], dtype=gray.dtype)
        assert (gray - expected).abs().max() < 5


def test_inaturalist_training_batches_are_224_pixels(inaturalist_root):
    data = load_splits("inaturalist", str(inaturalist_root), seed=0, data_workers=0)
    x, y = next(data.train.batches([torch.arange(6)], augment=True, seed=1))
    assert x.shape == (6, 3, 224, 224) and set(y.tolist()) <= {0, 1, 2}


def test_inaturalist2018_keeps_only_the_fungi_super_category_in_one_stratified_pool(inaturalist2018_root):
    data = load_splits("inaturalist2018", str(inaturalist2018_root), seed=0, data_workers=0)
    # 3 Fungi categories x 20 images = 60 in 15345:1705:1410:2000 (of 20460): exact shares 45.0,
    # 5.0, 4.13, 5.87 -> 45, 5, 4, 6
    assert data.sizes() == {"train": 45, "val": 5, "cal": 4, "test": 6}
    assert data.num_classes == 3 and data.input_shape == (3, 224, 224)
    ids = all_ids(data)
    assert ids.unique().numel() == ids.numel() == 3 * INATURALIST_2018_PER_SPECIES
    for split in SPLIT_NAMES:
        part = getattr(data, split)
        assert_stratified(part, torch.arange(3).repeat_interleave(INATURALIST_2018_PER_SPECIES), 3)
        x, y = next(part.batches([torch.arange(len(part))], augment=False, seed=0))
        assert x.shape == (len(part), 3, 224, 224)
        # flat gray images encode their category: ids 1, 2, 4 are labels 0, 1, 2, no other super-category
        gray = ((x * torch.tensor(IMAGENET_STD)[:, None, None] + torch.tensor(IMAGENET_MEAN)[:, None, None]) * 255).mean(dim=(1, 2, 3))
        expected = torch.tensor([fungi_gray(int(label)) for label in y], dtype=gray.dtype)
        assert (gray - expected).abs().max() < 5


def test_inaturalist2018_splits_follow_the_seed(inaturalist2018_root):
    first, again, other = (load_splits("inaturalist2018", str(inaturalist2018_root), seed=seed, data_workers=0) for seed in (0, 0, 1))
    assert torch.equal(first.train.ids, again.train.ids)
    assert not torch.equal(first.train.ids, other.train.ids)


def test_inaturalist2018_without_fungi_names_what_it_found(tmp_path):
    write_jpeg(tmp_path / "2018" / "Plantae" / "0" / "a.jpg", numpy.zeros((8, 8, 3), dtype=numpy.uint8))
    with pytest.raises(ValueError, match=r"no Fungi super-category under .*2018: it holds Plantae"):
        load_splits("inaturalist2018", str(tmp_path), seed=0)


# ----------------------------------------------------------------------------- missing data


@pytest.mark.parametrize(
    ("name", "title", "expected"),
    [
        ("cifar100", "CIFAR-100", "cifar-100-python"),
        ("caltech101", "Caltech-101", "caltech101/101_ObjectCategories"),
        ("inaturalist", "iNaturalist 2021", "2021_train_mini"),
        ("inaturalist2018", "iNaturalist 2018", "2018"),
    ],
)
def test_missing_data_is_named_before_anything_is_created(tmp_path, name, title, expected):
    with pytest.raises(FileNotFoundError, match=rf"{title}.* not found at {tmp_path / expected}.*pass --download"):
        load_splits(name, str(tmp_path), seed=0)
    assert list(tmp_path.iterdir()) == []  # torchvision's classes would have made folders
    with pytest.raises(FileNotFoundError, match=rf"pass --data-root DIR \(and --download to fetch {title}"):
        load_splits(name, None, seed=0)


def test_missing_cifar_files_are_listed(tmp_path):
    (tmp_path / "cifar-100-python").mkdir()
    (tmp_path / "cifar-100-python" / "train").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"\(no test, meta\); pass --download"):
        load_splits("cifar100", str(tmp_path), seed=0)


def test_inaturalist_needs_both_versions(inaturalist_root, tmp_path):
    (tmp_path / "2021_train_mini").symlink_to(inaturalist_root / "2021_train_mini")
    with pytest.raises(FileNotFoundError, match=f"not found at {tmp_path / '2021_valid'}"):
        load_splits("inaturalist", str(tmp_path), seed=0)


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.write_text, (pathlib.Path(self.marker), "code ran"))


def test_a_cifar_file_that_would_run_code_is_refused_unread(tmp_path):
    """The CIFAR-100 files are pickles on storage others may write (issue 21): they are read with
    an unpickler that knows arrays, lists and bytes only."""
    import pickle

    from dpsm_ray.data.vision import read_cifar100_file

    marker, path = tmp_path / "pwned", tmp_path / "train"
    path.write_bytes(pickle.dumps({b"data": _Planted(marker), b"fine_labels": [0]}, protocol=2))
    with pytest.raises(ValueError, match=r"train is not a CIFAR-100 file: it refers to \S+; a CIFAR-100 file holds only arrays"):
        read_cifar100_file(path)
    assert not marker.exists()
