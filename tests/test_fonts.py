"""The fonts benchmark on the real font files Debian's packages install (.ci/run installs them;
without them these tests are skipped, and the missing-files error is checked anyway)."""

import hashlib
import json

import numpy as np
import pytest
import torch

from dpsm_ray.cards import split_sizes
from dpsm_ray.facts import FONT_CLASSES, FONT_DESIGNS, font_faces
from dpsm_ray.cards import check_data_present, load_splits
from dpsm_ray.data import fonts
from dpsm_ray.data.preprocessing import pixel_statistics


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
    # first=0 (the default) is the benchmark as it was before the option: the same source, and the
    # same split ids as that code gave (their digest, computed with it at seed 0)
    zero = load_splits(TRANSFER + ",first=0", seed=0)
    assert torch.equal(zero.train.source.inputs, data.train.source.inputs)
    assert torch.equal(zero.train.source.labels, data.train.source.labels)
    split_ids = {split: getattr(zero, split).ids.tolist() for split in per_class}
    assert split_ids == {split: getattr(data, split).ids.tolist() for split in per_class}
    assert hashlib.sha256(json.dumps(split_ids).encode()).hexdigest()[:16] == "81fadac33b20ad85"
    assert (zero.input_spec, zero.class_names) == (data.input_spec, data.class_names)
    # the noise is an option of the renders: less noise, other images, the same glyphs' places
    quiet = fonts.rendered({**fonts.parse_fonts(BACKBONE), "noise": 0.0})
    assert quiet["images"].shape == arrays["images"].shape and np.array_equal(quiet["labels"], arrays["labels"])
    assert (quiet["images"] == 0).mean() > 0.6 > (arrays["images"] == 0).mean()  # no noise: a black background
    assert len(list((tmp_path / "fonts").iterdir())) == 2


def test_a_backbone_pretrained_on_other_fonts_data_is_refused_before_any_ray_work(tmp_path):
    """fonts_transfer cuts the renders, and takes the pixel statistics, of its backbone's data: a
    run's model.pt trained on other data (another class count, other renders, another dataset) is
    named with what differs, from the config.json beside it; a bare file cannot be checked."""
    from dpsm_ray.facts import fonts_backbone_problem
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


ROUND_THREE = "fonts_transfer:classes=79,first=62,shots=40,eval=5,noise=20,backbone_classes=62"  # docs/fidelity.md, round three
DISJOINT = "fonts_transfer:classes=3,first=4,shots=4,eval=1,noise=20,backbone_classes=4"  # its shape, small enough to render here
DISJOINT_BACKBONE = "fonts:classes=4,eval=1,noise=20"


@needs_fonts
def test_a_target_the_backbone_never_saw_is_cut_from_a_cache_that_has_it_and_scaled_by_the_backbones(tmp_path, monkeypatch):
    """fonts_transfer with first >= backbone_classes: classes first.. of the held-out renders of
    fonts:classes=first+classes, relabelled from 0, standardised by the backbone's own data -- whose
    renders of a class differ from that larger cache's, because one generator draws every render in
    turn: a class's images depend on how many classes the cache holds."""
    monkeypatch.setenv("DPSM_RAY_CACHE", str(tmp_path))
    backbone = load_splits(DISJOINT_BACKBONE, seed=0)
    data = load_splits(DISJOINT, seed=0)
    assert len(list((tmp_path / "fonts").iterdir())) == 2  # the backbone's renders and the 7-class renders
    monkeypatch.setattr(fonts, "render_face", lambda *args, **kwargs: pytest.fail("rendered again instead of reading the cache"))
    again, other = load_splits(DISJOINT, seed=0), load_splits(DISJOINT, seed=1)
    assert data.num_classes == 3 and data.class_names == tuple(FONT_CLASSES[4:7]) == ("4", "5", "6")
    assert data.sizes() == split_sizes(DISJOINT) == {"train": 12, "val": 15, "cal": 33, "test": 36}  # 32 held-out renders a class
    # every split image is a held-out render of class first + its label in the 7-class cache; all of them, once
    target = fonts.rendered(fonts.parse_fonts("fonts:classes=7,eval=1,noise=20"))
    trained = len(font_faces("train"))
    where = {image.tobytes(): (label, face) for image, label, face in zip(target["images"], target["labels"], target["faces"])}
    assert len(where) == len(target["images"])  # the noise makes every render unique
    found = []
    for split in ("train", "val", "cal", "test"):
        part = getattr(data, split)
        assert (torch.bincount(part.labels, minlength=3) == len(part) // 3).all() and part.labels.max() == 2
        for image, label in zip(part.inputs[:, 0].numpy(), part.labels.tolist()):
            source_label, face = where[image.tobytes()]
            assert source_label == 4 + label and face >= trained
            found.append(image.tobytes())
    held_out_renders = {image.tobytes() for image, label, face in zip(target["images"], target["labels"], target["faces"])
                        if label >= 4 and face >= trained}
    assert len(found) == len(set(found)) == len(held_out_renders) == 96 and set(found) == held_out_renders  # disjoint and complete
    # the pixel scale is the backbone's data's training faces', not that of the cache the images come from
    scale = (data.input_spec.mean, data.input_spec.std)
    assert scale == (backbone.input_spec.mean, backbone.input_spec.std)
    pretraining = fonts.rendered(fonts.parse_fonts(DISJOINT_BACKBONE))
    assert pixel_statistics(pretraining["images"][pretraining["faces"] < trained]) == scale
    assert pixel_statistics(target["images"][(target["faces"] < trained) & (target["labels"] < 4)]) != scale
    # why: the same class in the two caches is the same render in the first face only
    renders_of = lambda arrays, face: arrays["images"][(arrays["faces"] == face) & (arrays["labels"] == 0)]
    assert np.array_equal(renders_of(pretraining, 0), renders_of(target, 0))
    assert not np.array_equal(renders_of(pretraining, 1), renders_of(target, 1))
    assert torch.equal(data.train.ids, again.train.ids) and not torch.equal(data.train.ids, other.train.ids)


def test_a_target_partly_inside_the_backbones_classes_or_past_the_last_is_refused_naming_the_values():
    from dpsm_ray.facts import fonts_backbone_options, fonts_target_options, parse_fonts, parse_fonts_transfer

    assert split_sizes(ROUND_THREE) == {"train": 79 * 40, "val": 79 * 24, "cal": 79 * 48, "test": 79 * 48}  # 160 held-out renders a class
    options = parse_fonts_transfer(ROUND_THREE)
    assert fonts_backbone_options(options) == parse_fonts("fonts:classes=62,noise=20,eval=5")
    assert fonts_target_options(options) == parse_fonts("fonts:eval=5,noise=20")  # every class: round two's backbone data
    assert fonts_target_options(parse_fonts_transfer(TRANSFER)) == parse_fonts(BACKBONE)  # inside: the backbone's own renders
    split_sizes("fonts_transfer:classes=10,first=52,backbone_classes=62")  # the last ten of the backbone's classes
    for spec, values in [
        ("fonts_transfer:classes=79,first=50,backbone_classes=62", "classes=79, first=50, backbone_classes=62 (classes 50..128 against"),
        ("fonts_transfer:classes=80,first=62,backbone_classes=62", "classes=80, first=62, backbone_classes=62 (classes 62..141 against"),
        ("fonts_transfer:classes=10,first=-1,backbone_classes=62", "classes=10, first=-1, backbone_classes=62"),
        ("fonts_transfer:classes=10,first=135,backbone_classes=141", "classes=10, first=135, backbone_classes=141"),
    ]:
        with pytest.raises(ValueError) as error:
            split_sizes(spec)
        message = str(error.value)
        assert "\n" not in message and values in message and "(backbone_classes <= first, first + classes <= 141)" in message


def test_a_disjoint_targets_backbone_is_the_one_pretrained_on_the_other_classes(tmp_path):
    """Round three's target, the Greek and Cyrillic classes, takes weights pretrained on the digits
    and Latin letters (fonts:classes=62,eval=5,noise=20) and refuses any other backbone in one line,
    round two's (every class, the target's among them) included."""
    from dpsm_ray.facts import fonts_backbone_problem
    from dpsm_ray.config import ConfigError, TrainConfig, check_pretrained

    assert fonts_backbone_problem(ROUND_THREE, "fonts:classes=62,noise=20,eval=5") is None
    wanted = "fonts:classes=62,train=2,eval=5,noise=20"
    assert fonts_backbone_problem(ROUND_THREE, "fonts:eval=5,noise=20") == (
        f"were pretrained on fonts:eval=5,noise=20 (classes=141); {ROUND_THREE} is standardised by the pixel statistics of {wanted}"
        f" (classes=62): pretrain on that, or give {ROUND_THREE} the backbone's options"
    )
    assert "(noise=50); " in fonts_backbone_problem(ROUND_THREE, "fonts:classes=62,eval=5")
    refusal = fonts_backbone_problem(ROUND_THREE, "glyphs")
    assert refusal == f"were pretrained on glyphs; {ROUND_THREE} needs a backbone pretrained on {wanted}"
    run = tmp_path / "backbone"
    run.mkdir()
    weights = run / "model.pt"
    weights.write_bytes(b"")  # only its name is read here
    config = TrainConfig(dataset=ROUND_THREE, model="lenet", batch_size=16, pretrained_path=str(weights))
    (run / "config.json").write_text(json.dumps({"dataset": "fonts:classes=62,noise=20,eval=5"}))
    check_pretrained(config)
    (run / "config.json").write_text(json.dumps({"dataset": "fonts:noise=20,eval=5"}))
    with pytest.raises(ConfigError) as error:
        check_pretrained(config)
    assert error.value.field == "pretrained_path" and "\n" not in error.value.allowed
    assert error.value.allowed.startswith("the weights were pretrained on fonts:noise=20,eval=5 (classes=141)")


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
    with pytest.raises(ValueError, match=r"fonts_transfer needs 2 <= classes, 0 <= first, 2 <= backbone_classes <= 141, and its classes"):
        split_sizes("fonts_transfer:classes=120,backbone_classes=100")
    with pytest.raises(ValueError, match=r"1 <= shots <= 32 \* eval - 5"):
        split_sizes("fonts_transfer:shots=156")


def test_the_readme_and_ci_install_exactly_the_font_packages():
    from pathlib import Path

    from dpsm_ray.facts import FONT_PACKAGES

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
