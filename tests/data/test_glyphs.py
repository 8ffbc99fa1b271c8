import math

import pytest
import torch

from dpsm_ray.cards import check_dataset, load_splits, split_sizes

from dpsm_ray.data import SPLIT_NAMES, make_glyphs
from dpsm_ray.data.glyphs import AUGMENT_PADDING, PER_CLASS_EVAL, POOL, SIZE, STROKES, glyph_strokes, parse_glyphs
from dpsm_ray.cards import build_model, default_model

SMALL = "glyphs:classes=5,train=4"


def test_options_default_to_100_classes_of_20_training_images():
    assert parse_glyphs("glyphs") == {"classes": 100, "train": 20, "noise": 0.2}
    assert parse_glyphs("glyphs:noise=0.5,classes=7") == {"classes": 7, "train": 20, "noise": 0.5}
    # 20 training images per class, then 10 validation, 10 calibration and 20 test images per class
    assert split_sizes("glyphs") == {"train": 2000, "val": 1000, "cal": 1000, "test": 2000}
    assert split_sizes("glyphs:classes=3,train=5") == {"train": 15, "val": 30, "cal": 30, "test": 60}


@pytest.mark.parametrize(("name", "message"), [
    ("glyphs:clases=3", "unknown glyphs option 'clases'"),
    ("glyphs:classes=many", "glyphs option classes must be a number"),
    ("glyphs:classes=1", "2 <= classes <= 2024"),
    ("glyphs:classes=2025", "2 <= classes <= 2024"),  # C(24, 3) distinct glyphs
    ("glyphs:train=1", "train >= 2"),
    ("glyphs:noise=-0.1", "noise >= 0"),
])
def test_bad_options_are_named_with_their_range(name, message):
    with pytest.raises(ValueError, match=message):
        check_dataset(name)


def test_every_class_is_its_own_combination_of_distinct_strokes():
    pool, members = glyph_strokes(300, seed=0)
    assert pool.shape == (POOL, 2, 2) and members.shape == (300, STROKES)
    assert math.comb(POOL, STROKES) == 2024
    assert all(len(set(row)) == STROKES for row in members.tolist())
    assert len({tuple(sorted(row)) for row in members.tolist()}) == 300
    # every stroke end leaves room for the jitter and a 2-pixel shift inside the canvas
    assert pool.min() >= 3 and pool.max() <= SIZE - 4


def test_images_are_balanced_seeded_and_drawn_on_a_blank_background():
    images, labels = make_glyphs(4, 6, noise=0.0, seed=0)
    assert images.shape == (24, 1, SIZE, SIZE) and torch.bincount(labels).tolist() == [6] * 4
    again, _ = make_glyphs(4, 6, noise=0.0, seed=0)
    assert torch.equal(images, again)
    assert not torch.equal(images, make_glyphs(4, 6, noise=0.0, seed=1)[0])
    # without noise: ink in [0, 1] (strokes at intensity 0.5 to 1 do not add up where they cross),
    # every image has a stroke, and most of the canvas is blank
    assert images.min() >= 0 and images.max() <= 1
    assert (images.flatten(1).amax(1) >= 0.5).all()
    assert (images < 1e-3).float().mean() > 0.5
    noisy, _ = make_glyphs(4, 6, noise=0.3, seed=0)
    assert 0.25 < (noisy - images).std() < 0.35


def test_splits_hold_the_stated_images_of_every_class_and_are_disjoint():
    data = load_splits(SMALL, seed=0)
    assert data.num_classes == 5 and data.input_shape == (1, SIZE, SIZE)
    assert data.sizes() == split_sizes(SMALL)
    per_class = {"train": 4, **PER_CLASS_EVAL}
    for name in SPLIT_NAMES:
        assert torch.bincount(getattr(data, name).labels).tolist() == [per_class[name]] * 5
    ids = torch.cat([getattr(data, name).ids for name in SPLIT_NAMES])
    assert ids.unique().numel() == ids.numel()
    other = load_splits(SMALL, seed=1)
    assert not torch.equal(other.train.ids, data.train.ids)  # the split follows the run seed
    assert torch.equal(other.train.source.inputs, data.train.source.inputs)  # the images do not


def test_inputs_are_standardised_on_the_training_split():
    data = load_splits(SMALL, seed=0)
    x, _ = next(data.train.batches([torch.arange(len(data.train))], augment=False, seed=0))
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std()) - 1) < 1e-3


def test_augmentation_shifts_each_image_by_at_most_one_pixel_whatever_its_batch():
    data = load_splits(SMALL, seed=0)
    positions = torch.arange(len(data.train))
    plain, _ = next(data.train.batches([positions], augment=False, seed=0))
    shifted, _ = next(data.train.batches([positions], augment=True, seed=7))
    standardised = data.input_spec
    blank = -standardised.mean / standardised.std  # the raw background 0, standardised
    padded = torch.nn.functional.pad(plain, (AUGMENT_PADDING,) * 4, value=blank)
    offsets = range(2 * AUGMENT_PADDING + 1)
    moved = 0
    for image, expected in zip(shifted, padded):
        matches = [(top, left) for top in offsets for left in offsets if torch.allclose(image, expected[:, top : top + SIZE, left : left + SIZE], atol=1e-6)]
        assert matches, "an augmented image is not a shift of its image by at most 1 pixel"
        moved += matches[0] != (AUGMENT_PADDING, AUGMENT_PADDING)
    assert moved > len(positions) // 2  # 8 of 9 shifts move the image
    # an example's shift depends on (seed, example id), not on the batch it is drawn in
    alone = torch.cat([x for x, _ in data.train.batches(list(positions.split(3)), augment=True, seed=7)])
    assert torch.equal(alone, shifted)


def test_glyphs_load_without_touching_the_global_rng():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    data = load_splits(SMALL, seed=0)
    next(data.train.batches([torch.arange(4)], augment=True, seed=1))
    assert torch.equal(torch.get_rng_state(), before)


def test_the_default_model_is_a_lenet_that_maps_glyphs_to_class_logits():
    assert default_model("glyphs:classes=5") == "lenet"
    model = build_model("lenet", 5, input_shape=(1, SIZE, SIZE))
    assert model(torch.zeros(2, 1, SIZE, SIZE)).shape == (2, 5)
    with pytest.raises(ValueError, match="lenet needs image inputs"):
        build_model("lenet", 5, input_shape=(64,))
