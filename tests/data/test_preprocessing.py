"""``InputSpec``: what a predictor records about its inputs is exactly what the loaders evaluate with."""

import json

import numpy
import pytest
import torch
from fake_datasets import write_caltech101, write_cifar100

from dpsm_ray.cards import load_splits

from dpsm_ray.data import SPLIT_NAMES
from dpsm_ray.data.preprocessing import InputSpec
from dpsm_ray.predict.inputs import read_image


def test_apply_divides_then_standardises_as_written():
    spec = InputSpec((3, 1, 1), 255.0, [[[0.5]], [[0.25]], [[0.0]]], [[[0.5]], [[0.25]], [[1.0]]], "pixels")
    raw = torch.tensor([0, 255], dtype=torch.uint8).reshape(2, 1, 1, 1).expand(2, 3, 1, 1)
    out = spec.apply(raw)
    assert out.dtype == torch.float32
    # (0 / 255 - 0.5) / 0.5 = -1, (0 - 0.25) / 0.25 = -1, (0 - 0) / 1 = 0; then 255 / 255 = 1 in each channel
    torch.testing.assert_close(out[:, :, 0, 0], torch.tensor([[-1.0, -1.0, 0.0], [1.0, 3.0, 1.0]]))


def test_a_spec_survives_json_and_bad_fields_are_named():
    data = load_splits("digits", seed=0)
    spec = data.input_spec
    again = InputSpec.from_json(json.loads(json.dumps(spec.to_json())))
    raw = data.test.source.inputs[data.test.ids]
    assert torch.equal(again.apply(raw), spec.apply(raw))
    payload = spec.to_json()
    with pytest.raises(ValueError, match="input lacks the field 'divisor'"):
        InputSpec.from_json({k: v for k, v in payload.items() if k != "divisor"})
    with pytest.raises(ValueError, match=r"input.mean of shape \[3\] does not broadcast against the input shape \[1, 8, 8\]"):
        InputSpec.from_json({**payload, "mean": [0.0, 0.0, 0.0]})
    with pytest.raises(ValueError, match="input.std must be > 0"):
        InputSpec.from_json({**payload, "std": 0.0})
    with pytest.raises(ValueError, match=r"input.image.mode must be one of L, RGB; got 'CMYK'"):
        InputSpec.from_json({**payload, "image": {**payload["image"], "mode": "CMYK"}})


@pytest.mark.parametrize("name", ["digits", "synthetic:classes=4,dim=3,size=400", "glyphs:classes=5,train=4"])
def test_the_spec_of_a_tensor_dataset_is_its_evaluation_transform_to_the_last_bit(name):
    data = load_splits(name, seed=3)
    for split_name in SPLIT_NAMES:
        split = getattr(data, split_name)
        positions = torch.arange(len(split))
        x, _ = next(split.batches([positions], augment=False, seed=0))
        assert torch.equal(data.input_spec.apply(split.source.inputs[split.ids]), x)
    assert data.input_spec.shape == data.input_shape


def test_digits_are_standardised_raw_pixels_and_have_class_names():
    data = load_splits("digits", seed=0)
    raw = data.train.source.inputs[data.train.ids]
    assert raw.min() == 0 and raw.max() == 16 and torch.equal(raw, raw.round())  # sklearn's pixel values, untouched
    mean, std = (raw / 16).mean(0), (raw / 16).std(0).clamp(min=1e-3)
    torch.testing.assert_close(torch.tensor(data.input_spec.mean), mean, rtol=0, atol=0)
    # every split's evaluation input is the training split's standardisation, written out here
    for split in (data.train, data.val, data.cal, data.test):
        x, _ = next(split.batches([torch.arange(len(split))], augment=False, seed=0))
        assert torch.equal(x, (split.source.inputs[split.ids] / 16.0 - mean) / std)
    assert data.class_names == tuple("0123456789")


def test_cifar100_spec_is_its_transform_and_names_its_classes(tmp_path):
    write_cifar100(tmp_path)
    data = load_splits("cifar100", str(tmp_path), seed=0)
    positions = torch.arange(len(data.test))
    x, _ = next(data.test.batches([positions], augment=False, seed=0))
    assert torch.equal(data.input_spec.apply(data.test.source.inputs[data.test.ids]), x)
    assert data.class_names[:2] == ("class0", "class1") and len(data.class_names) == 100


def test_an_image_file_read_as_the_spec_says_gives_the_224_pixel_datasets_evaluation_input(tmp_path):
    write_caltech101(tmp_path)
    data = load_splits("caltech101", str(tmp_path), seed=0, data_workers=0)
    dataset = data.test.source.dataset
    for position in range(4):
        example = int(data.test.ids[position])
        x, _ = next(data.test.batches([torch.tensor([position])], augment=False, seed=0))
        file = tmp_path / "caltech101" / "101_ObjectCategories" / dataset.categories[dataset.y[example]] / f"image_{dataset.index[example]:04d}.jpg"
        raw = torch.from_numpy(numpy.ascontiguousarray(read_image(file, data.input_spec)))[None]
        assert raw.shape == (1, 3, 224, 224)
        assert torch.equal(data.input_spec.apply(raw), x)
    assert data.class_names == tuple(dataset.categories)


def test_mean_and_std_go_to_a_device_once_and_a_pickle_holds_the_hosts_copies_only():
    import pickle

    spec = InputSpec((3, 1, 1), 255.0, [[[0.5]], [[0.25]], [[0.0]]], [[[0.5]], [[0.25]], [[1.0]]], "pixels")
    first = spec.constants(torch.device("meta"))
    assert [t.device.type for t in first] == ["meta", "meta"]
    assert all(a is b for a, b in zip(spec.constants(torch.device("meta")), first))  # no copy per batch
    again = pickle.loads(pickle.dumps(spec))
    assert list(again._tensors) == [torch.device("cpu")] and again == spec
    raw = torch.tensor([0, 255], dtype=torch.uint8).reshape(2, 1, 1, 1).expand(2, 3, 1, 1)
    torch.testing.assert_close(again.apply(raw), spec.apply(raw))
