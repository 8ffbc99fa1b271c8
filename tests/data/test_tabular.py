import pytest
import numpy as np
import torch

from dpsm_ray.cards import load_splits, split_sizes

from dpsm_ray.data import SPLIT_NAMES, make_synthetic, stratified_partition


def test_stratified_partition_is_disjoint_sized_and_stratified():
    labels = torch.arange(1000) % 7
    parts = stratified_partition(labels, [500, 200, 100, 150], seed=3)
    assert [p.numel() for p in parts] == [500, 200, 100, 150]
    everything = torch.cat(parts)
    assert everything.unique().numel() == everything.numel()  # no index twice
    overall = torch.bincount(labels, minlength=7).double() / 1000
    for part in parts:
        share = torch.bincount(labels[part], minlength=7).double()
        assert (share - overall * part.numel()).abs().max() <= 1.0 + 1e-9  # within one example per class


def test_stratified_partition_depends_on_the_seed_only():
    labels = torch.arange(300) % 3
    assert all(torch.equal(a, b) for a, b in zip(stratified_partition(labels, [100, 100], 1), stratified_partition(labels, [100, 100], 1)))
    assert not torch.equal(stratified_partition(labels, [100], 1)[0], stratified_partition(labels, [100], 2)[0])


def test_partition_rejects_sizes_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        stratified_partition(torch.zeros(10, dtype=torch.long), [6, 6], 0)


@pytest.mark.parametrize("name", ["digits", "synthetic:classes=5,size=1000,dim=4"])
def test_splits_are_disjoint_and_sized_as_documented(name):
    data = load_splits(name, seed=0)
    assert data.sizes() == split_sizes(name)
    ids = torch.cat([getattr(data, split).ids for split in SPLIT_NAMES])
    assert ids.unique().numel() == ids.numel()
    x, y = next(data.train.batches([torch.arange(4)], augment=False, seed=0))
    assert x.shape == (4, *data.input_shape) and y.shape == (4,)


def test_digits_features_are_standardised_on_the_training_split():
    data = load_splits("digits", seed=0)
    x, _ = next(data.train.batches([torch.arange(len(data.train))], augment=False, seed=0))
    assert x.mean(0).abs().max() < 1e-4


def test_synthetic_classes_differ_in_difficulty_and_are_seeded():
    x1, y1 = make_synthetic(4, 3, 400, 1.0, seed=0)
    x2, y2 = make_synthetic(4, 3, 400, 1.0, seed=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.bincount(y1).tolist() == [100] * 4
    spread = [x1[y1 == c].std(0).mean().item() for c in range(4)]
    assert spread[0] < spread[-1]


def test_bad_synthetic_options_are_named():
    with pytest.raises(ValueError, match="unknown synthetic option 'clases'"):
        load_splits("synthetic:clases=3", seed=0)
    with pytest.raises(ValueError, match="synthetic option size must be a number; got '1e3x'"):
        load_splits("synthetic:size=1e3x", seed=0)


def test_the_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sklearn_digits

    from dpsm_ray.data.tabular import digits_arrays

    pixels, targets = digits_arrays()
    bunch = sklearn_digits()
    assert pixels.dtype == bunch.data.dtype and targets.dtype == bunch.target.dtype
    assert np.array_equal(pixels, bunch.data) and np.array_equal(targets, bunch.target)
    code = "import sys; from dpsm_ray.data.tabular import digits_arrays; digits_arrays(); assert 'sklearn' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
