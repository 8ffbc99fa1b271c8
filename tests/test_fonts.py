"""The fonts benchmark on the real font files Debian's packages install (.ci/run installs them;
without them these tests are skipped, and the missing-files error is checked anyway)."""

import json

import numpy as np
import pytest
import torch

from dpsm_ray.cards import split_sizes
from dpsm_ray.catalog import FONT_CLASSES, FONT_DESIGNS, font_faces
from dpsm_ray.cards import check_data_present, load_splits
from dpsm_ray.data import fonts


def installed() -> bool:
    try:
        fonts.find_faces()
    except FileNotFoundError:
        return False
    return True


needs_fonts = pytest.mark.skipif(not installed(), reason=f"needs the font packages ({fonts.APT_LINE}; .ci/run installs them)")
CANDIDATES = "".join(map(chr, [*range(0x30, 0x3A), *range(0x41, 0x5B), *range(0x61, 0x7B), *(c for c in range(0x391, 0x3AA) if c != 0x3A2), *range(0x3B1, 0x3CA),
                               *range(0x410, 0x450)]))  # digits, Latin, Greek (no final-sigma capital), Cyrillic (no Ё)
SMALL = "fonts:classes=12,train=1,eval=3"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The first 12 classes, split with two run seeds, rendered once into an empty cache."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DPSM_RAY_CACHE", str(cache))
        first = load_splits(SMALL, seed=0)
        files = list((cache / "fonts").iterdir())

        def no_rendering(*args, **kwargs):
            raise AssertionError("rendered again instead of reading the cache")

        patch.setattr(fonts, "render_face", no_rendering)
        again, other = load_splits(SMALL, seed=0), load_splits(SMALL, seed=1)
    return first, again, other, files


def face_of(data, split) -> np.ndarray:
    arrays = fonts.rendered(fonts.parse_fonts(SMALL))
    return arrays["faces"][getattr(data, split).ids.numpy()]


@needs_fonts
def test_the_classes_are_the_look_alike_rule_applied_to_the_installed_fonts():
    """A Greek or Cyrillic letter is a class unless its glyph is pixel-identical to an earlier
    candidate's in at least half of the faces: Latin A, Greek Alpha and Cyrillic A are one class."""
    faces = fonts.find_faces()
    counts = fonts.identical_glyphs(faces, CANDIDATES)
    dropped = {later for (earlier, later), count in counts.items() if 2 * count >= len(faces)}
    assert "".join(c for c in CANDIDATES if c not in dropped) == FONT_CLASSES
    assert len(CANDIDATES) == 175 and len(FONT_CLASSES) == 141
    assert {"Α", "А", "О", "Ο", "о", "ο"} <= dropped and not {"Ж", "Ф", "Ψ", "λ"} & dropped
    assert counts[("A", "Α")] >= 64 and counts.get(("m", "т"), 0) < 64  # italic т looks like m in some faces only: it stays


@needs_fonts
def test_renders_are_split_by_design_with_exchangeable_calibration_and_test(small):
    first, again, other, files = small
    assert first.sizes() == split_sizes(SMALL) == {"train": 12 * 96, "val": 12 * 16, "cal": 12 * 40, "test": 12 * 40}
    assert first.num_classes == 12 and first.input_shape == (1, 32, 32) and first.class_names == tuple(FONT_CLASSES[:12])
    trained = len(font_faces("train"))
    assert (face_of(first, "train") < trained).all()
    for split in ("val", "cal", "test"):  # every held-out image is in a face of a held-out design
        assert (face_of(first, split) >= trained).all()
        counts = torch.bincount(getattr(first, split).labels, minlength=12)
        assert (counts == len(getattr(first, split)) // 12).all()
    held_out_designs = {design for design, (where, _) in FONT_DESIGNS.items() if where == "held_out"}
    assert held_out_designs == {"Cousine and Liberation Mono", "Noto", "Century Schoolbook-like serif", "Avant Garde-like sans"}
    ids = {split: set(getattr(first, split).ids.tolist()) for split in ("train", "val", "cal", "test")}
    assert sum(map(len, ids.values())) == len(set().union(*ids.values()))  # disjoint
    # the cache gives the same images; another run seed another cut of the same held-out renders
    assert len(files) == 1 and files[0].suffix == ".npz"
    for split in ("train", "val", "cal", "test"):
        assert torch.equal(getattr(first, split).ids, getattr(again, split).ids)
    assert torch.equal(first.train.ids, other.train.ids) and not torch.equal(first.cal.ids, other.cal.ids)
    assert set(first.val.ids.tolist()) | set(first.cal.ids.tolist()) | set(first.test.ids.tolist()) == \
        set(other.val.ids.tolist()) | set(other.cal.ids.tolist()) | set(other.test.ids.tolist())


@needs_fonts
def test_a_batch_is_standardised_by_the_training_split_and_shifted_only_when_training(small):
    first = small[0]
    source = first.train.source
    raw = source.inputs[first.train.ids].float() / 255
    assert abs(first.input_spec.mean - float(raw.mean())) < 1e-6 and abs(first.input_spec.std - float(raw.std())) < 1e-3
    positions = torch.arange(16)
    x, y = next(first.train.batches([positions], augment=False, seed=0))
    expected = (source.inputs[first.train.ids[:16]].float() / 255 - first.input_spec.mean) / first.input_spec.std
    assert torch.allclose(x, expected, atol=1e-5) and torch.equal(y, source.labels[first.train.ids[:16]].long())
    shifted, _ = next(first.train.batches([positions], augment=True, seed=0))
    assert shifted.shape == x.shape and not torch.equal(shifted, x)
    # a shift moves the glyph, it does not change its ink
    ink = lambda batch: (batch * first.input_spec.std + first.input_spec.mean).sum(dim=(1, 2, 3))
    assert torch.allclose(ink(shifted), ink(x), rtol=0.35)


TRANSFER = "fonts_transfer:classes=6,backbone_classes=12,shots=4,eval=3,noise=20"
BACKBONE = "fonts:classes=12,eval=3,noise=20"  # the data TRANSFER's backbone is pretrained on


@needs_fonts
def test_the_transfer_benchmark_cuts_the_held_out_renders_of_its_backbones_data(tmp_path, monkeypatch):
    """fonts_transfer: every split from the held-out faces, ``shots`` training images a class, the
    rest cut into validation, calibration and test; the renders and the pixel scale are those of
    the backbone's data (one cache file for both), and the run seed chooses the cut."""
    monkeypatch.setenv("DPSM_RAY_CACHE", str(tmp_path))
    backbone = load_splits(BACKBONE, seed=0)
    data, again, other = (load_splits(TRANSFER, seed=seed) for seed in (0, 0, 1))
    assert len(list((tmp_path / "fonts").iterdir())) == 1  # the same renders: nothing rendered again
    per_class = {"train": 4, "val": 18, "cal": 37, "test": 37}  # 32 faces x 3 renders = 96: 4, then 92 as 18 / 37 / 37
    assert data.sizes() == split_sizes(TRANSFER) == {split: 6 * n for split, n in per_class.items()}
    assert data.num_classes == 6 and data.class_names == tuple(FONT_CLASSES[:6])
    arrays = fonts.rendered(fonts.parse_fonts(BACKBONE))
    trained = len(font_faces("train"))
    ids = {}
    for split, count in per_class.items():
        part = getattr(data, split)
        ids[split] = set(part.ids.tolist())
        assert (arrays["faces"][part.ids.numpy()] >= trained).all()  # held-out faces only
        assert (torch.bincount(part.labels, minlength=6) == count).all() and part.labels.max() < 6
    assert sum(map(len, ids.values())) == len(set().union(*ids.values())) == 6 * 96  # disjoint, every held-out render of the 6
    assert (data.input_spec.mean, data.input_spec.std) == (backbone.input_spec.mean, backbone.input_spec.std)
    assert torch.equal(data.train.source.inputs, backbone.train.source.inputs)  # the same images
    assert torch.equal(data.train.ids, again.train.ids) and not torch.equal(data.train.ids, other.train.ids)
    # the noise is an option of the renders: less noise, other images, the same glyphs' places
    quiet = fonts.rendered({**fonts.parse_fonts(BACKBONE), "noise": 0.0})
    assert quiet["images"].shape == arrays["images"].shape and np.array_equal(quiet["labels"], arrays["labels"])
    assert (quiet["images"] == 0).mean() > 0.6 > (arrays["images"] == 0).mean()  # no noise: a black background
    assert len(list((tmp_path / "fonts").iterdir())) == 2


def test_a_backbone_pretrained_on_other_fonts_data_is_refused_before_any_ray_work(tmp_path):
    """fonts_transfer cuts the renders, and takes the pixel statistics, of its backbone's data: a
    run's model.pt trained on other data (another class count, other renders, another dataset) is
    named with what differs, from the config.json beside it; a bare file cannot be checked."""
    from dpsm_ray.catalog import fonts_backbone_problem
    from dpsm_ray.config import ConfigError, TrainConfig, check_pretrained

    assert fonts_backbone_problem(TRANSFER, BACKBONE) is None
    assert fonts_backbone_problem(TRANSFER, "fonts:eval=3,classes=12,noise=20.0") is None  # the same options in another spelling
    wanted = "fonts:classes=12,train=2,eval=3,noise=20"
    assert fonts_backbone_problem(TRANSFER, "fonts:classes=20,eval=3,noise=20") == (
        f"were pretrained on fonts:classes=20,eval=3,noise=20 (classes=20); {TRANSFER} cuts the renders of {wanted} (classes=12):"
        f" pretrain on that, or give {TRANSFER} the backbone's options"
    )
    assert "(eval=5, noise=50); " in fonts_backbone_problem(TRANSFER, "fonts:classes=12,eval=5")  # noise left at the fonts default, 50
    assert fonts_backbone_problem(TRANSFER, "glyphs") == f"were pretrained on glyphs; {TRANSFER} needs a backbone pretrained on {wanted}"
    run = tmp_path / "backbone"
    run.mkdir()
    weights = run / "model.pt"
    weights.write_bytes(b"")  # only its name is read here
    config = TrainConfig(dataset=TRANSFER, model="lenet", batch_size=16, pretrained_path=str(weights))
    check_pretrained(config)  # no config.json beside it: nothing says what it trained on
    (run / "config.json").write_text(json.dumps({"dataset": BACKBONE}))
    check_pretrained(config)
    (run / "config.json").write_text(json.dumps({"dataset": "fonts:classes=20,eval=3,noise=20"}))
    with pytest.raises(ConfigError) as error:
        check_pretrained(config)
    assert error.value.field == "pretrained_path" and error.value.allowed.startswith("the weights were pretrained on fonts:classes=20")
    with pytest.raises(ConfigError, match="no such file"):
        check_pretrained(TrainConfig(dataset=TRANSFER, model="lenet", batch_size=16, pretrained_path=str(tmp_path / "missing.pt")))
    check_pretrained(TrainConfig(dataset="fonts", model="lenet", pretrained_path=str(weights)))  # fonts takes any lenet weights


@needs_fonts
def test_a_render_is_a_centred_white_glyph_on_black_and_the_jitter_moves_it():
    path = fonts.find_faces()[("DejaVu Sans", "Book")]
    plain = fonts.render(path, "H", point_size=40)
    assert plain.shape == (32, 32) and plain.dtype == np.uint8 and plain[0].max() == 0 and plain.max() == 255
    rows, cols = np.nonzero(plain > 127)
    assert abs(cols.mean() - 15.5) < 1.5 and abs(rows.mean() - 15.5) < 3  # the "mm" anchor
    shifted = fonts.render(path, "H", point_size=40, shift=(4, 0))
    assert abs(np.nonzero(shifted > 127)[1].mean() - cols.mean() - 2) < 0.5  # 4 pixels at twice the size: 2 here
    assert (fonts.render(path, "H", point_size=40, stroke=1) > 127).sum() > (plain > 127).sum()
    assert not np.array_equal(fonts.render(path, "H", point_size=40, angle=10), plain)


@needs_fonts
def test_each_render_is_its_jittered_glyph_dimmed_and_noised_by_the_seeded_generator():
    path = fonts.find_faces()[("DejaVu Sans", "Book")]
    images = fonts.render_face(path, "AB", 2, np.random.default_rng(7))
    replay = np.random.default_rng(7)  # the same draws, in the order the docstring gives them
    for index, character in enumerate("AABB"):
        jitter = dict(point_size=int(replay.choice(fonts.POINT_SIZES)), angle=float(replay.uniform(-fonts.ROTATION, fonts.ROTATION)),
                      shift=(int(replay.integers(-fonts.SHIFT, fonts.SHIFT + 1)), int(replay.integers(-fonts.SHIFT, fonts.SHIFT + 1))),
                      stroke=int(replay.choice(fonts.STROKES)))
        glyph = fonts.render(path, character, **jitter)
        ink = replay.uniform(*fonts.CONTRAST)
        expected = np.clip(np.rint(glyph * ink + replay.normal(0.0, fonts.NOISE, size=glyph.shape)), 0, 255).astype(np.uint8)
        assert np.array_equal(images[index], expected)
        # the black background now holds the noise: max(0, N(0, 50)), mean 50 / sqrt(2 pi) = 19.9, zero half the time
        background = images[index][glyph == 0].astype(float)
        assert abs(background.mean() - fonts.NOISE / np.sqrt(2 * np.pi)) < 4 and 0.4 < (background == 0).mean() < 0.6


def test_missing_fonts_are_named_with_the_packages_that_install_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dataset fonts: 128 of its 128 font faces are not under .*apt-get install fonts-dejavu-core"):
        check_data_present("fonts", data_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"fonts needs 2 <= classes <= 141"):
        split_sizes("fonts:classes=500")
    with pytest.raises(ValueError, match=r"unknown fonts option 'blur'"):
        split_sizes("fonts:blur=1")
    with pytest.raises(ValueError, match=r"fonts needs .* noise >= 0"):
        split_sizes("fonts:noise=-1")
    with pytest.raises(ValueError, match=r"fonts_transfer needs 2 <= classes <= backbone_classes"):
        split_sizes("fonts_transfer:classes=120,backbone_classes=100")
    with pytest.raises(ValueError, match=r"1 <= shots <= 32 \* eval - 5"):
        split_sizes("fonts_transfer:shots=156")


def test_the_readme_and_ci_install_exactly_the_font_packages():
    from pathlib import Path

    from dpsm_ray.catalog import FONT_PACKAGES

    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text().split())
    assert f"apt-get install {' '.join(FONT_PACKAGES)}" in readme
    ci = (root / ".ci" / "run").read_text().replace("\\\n", " ")
    assert all(f" {package} " in f" {' '.join(ci.split())} " for package in FONT_PACKAGES)


def test_an_unreadable_font_file_under_the_folder_is_skipped_not_fatal(tmp_path):
    (tmp_path / "broken.ttf").write_bytes(b"\x00\x01\x00\x00 not a font")
    (tmp_path / "empty.otf").write_bytes(b"")
    assert fonts.face_name(tmp_path / "broken.ttf") is None and fonts.face_name(tmp_path / "empty.otf") is None
    with pytest.raises(FileNotFoundError, match="128 of its 128 font faces are not under"):
        fonts.find_faces(tmp_path)
