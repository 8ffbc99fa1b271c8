import pytest
import torch
import torch.nn.functional as F

from dpsm_ray.data.augment import crop_and_flip, crop_offsets, flip_mask, random_crop, random_crop_flip
from dpsm_ray.data.vision import CIFAR100_INPUT, cifar100_transform


def slow_crop_and_flip(images, top, left, flip, padding):
    """One image at a time: zero-pad, slice the window, mirror it."""
    height, width = images.shape[-2:]
    out = []
    for image, t, l, f in zip(images, top.tolist(), left.tolist(), flip.tolist()):
        window = F.pad(image, (padding,) * 4)[:, t : t + height, l : l + width]
        out.append(window.flip(-1) if f else window)
    return torch.stack(out)


def random_images(count, channels=3, height=32, width=32, seed=0):
    return torch.randint(0, 256, (count, channels, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("shape", "padding"), [((16, 3, 32, 32), 4), ((5, 2, 6, 9), 2), ((3, 1, 4, 4), 0)])
def test_batched_crop_and_flip_equals_the_per_image_reference(shape, padding):
    images = random_images(*shape)
    gen = torch.Generator().manual_seed(1)
    top = torch.randint(0, 2 * padding + 1, (shape[0],), generator=gen)
    left = torch.randint(0, 2 * padding + 1, (shape[0],), generator=gen)
    flip = torch.rand(shape[0], generator=gen) < 0.5
    assert torch.equal(crop_and_flip(images, top, left, flip, padding), slow_crop_and_flip(images, top, left, flip, padding))


def test_the_centre_window_without_flip_is_the_image():
    images = random_images(4)
    centre = torch.full((4,), 4)
    assert torch.equal(crop_and_flip(images, centre, centre, torch.zeros(4, dtype=torch.bool), 4), images)


def test_random_crop_is_the_crop_of_random_crop_flip_never_mirrored():
    images, ids = random_images(32, channels=1, height=16, width=16), torch.arange(100, 132)
    top, left = crop_offsets(ids, 3, 1)
    never = torch.zeros(32, dtype=torch.bool)
    assert torch.equal(random_crop(images, ids, 3, 1), slow_crop_and_flip(images, top, left, never, 1))
    flipped = flip_mask(ids, 3)
    assert flipped.any() and torch.equal(random_crop_flip(images, ids, 3, 1)[~flipped], random_crop(images, ids, 3, 1)[~flipped])


def test_an_examples_augmentation_does_not_depend_on_its_batch():
    images = random_images(64)
    ids = torch.randperm(10_000, generator=torch.Generator().manual_seed(2))[:64]  # any ids, any order
    batch = random_crop_flip(images, ids, seed=5)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    shuffled = random_crop_flip(images[order], ids[order], seed=5)
    assert torch.equal(shuffled, batch[order])
    for i in (0, 17, 63):
        assert torch.equal(random_crop_flip(images[i : i + 1], ids[i : i + 1], seed=5)[0], batch[i])
    assert not torch.equal(random_crop_flip(images, ids, seed=6), batch)  # a new epoch's seed, a new draw


def test_offsets_cover_every_position_and_half_the_examples_flip():
    ids = torch.arange(20_000)
    top, left = crop_offsets(ids, seed=0, padding=4)
    assert top.min() == left.min() == 0 and top.max() == left.max() == 8
    counts = torch.bincount(top * 9 + left, minlength=81)
    assert counts.numel() == 81 and counts.min() > 150  # all 9 x 9 windows, each ~247 times
    assert abs(flip_mask(ids, seed=0).double().mean().item() - 0.5) < 0.02
    assert torch.corrcoef(torch.stack([top.double(), left.double()]))[0, 1].abs() < 0.05  # independent draws


def test_evaluation_never_augments():
    images, ids = random_images(8), torch.arange(8)
    plain = CIFAR100_INPUT.apply(images)
    for seed in range(5):
        assert torch.equal(cifar100_transform(images, ids, False, seed), plain)
    assert not torch.equal(cifar100_transform(images, ids, True, 0), plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_augmentation_on_the_gpu_equals_the_cpu():
    images, ids = random_images(128), torch.arange(1000, 1128)
    on_gpu = cifar100_transform(images.cuda(), ids.cuda(), True, 11)
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), cifar100_transform(images, ids, True, 11))


def tensor_source_batches(device):
    """Augmented CIFAR-100-shaped batches of uneven sizes from a TensorSource on ``device``."""
    from dpsm_ray.data import TensorSource

    images = random_images(40)
    source = TensorSource(images, torch.arange(40) % 7, cifar100_transform).to(device)
    ids = [torch.tensor([3, 1, 4, 15, 9]), torch.tensor([2, 6, 5]), torch.tensor([35, 8, 39, 0])]
    return [(x.cpu(), y.cpu()) for x, y in source.batches(ids, augment=True, seed=5)], ids, images


def test_a_tensor_source_batch_is_its_examples_augmented_alone():
    batches, ids, images = tensor_source_batches("cpu")
    for (x, y), chosen in zip(batches, ids, strict=True):
        assert torch.equal(y, chosen % 7)
        for row, example in zip(x, chosen):  # an example's augmentation depends on its id, not its batch
            assert torch.equal(row, cifar100_transform(images[example : example + 1], example[None], True, 5)[0])


def test_batch_ids_go_to_the_device_in_one_copy_in_their_sizes():
    from dpsm_ray.data.splits import on_device

    ids = [torch.tensor([3, 1, 4, 15, 9]), torch.tensor([2, 6, 5]), torch.tensor([], dtype=torch.long)]
    moved = on_device(ids, torch.device("meta"))
    assert [t.device.type for t in moved] == ["meta"] * 3 and [t.numel() for t in moved] == [5, 3, 0]
    assert on_device(ids, torch.device("cpu")) is ids and on_device([], torch.device("meta")) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensor_source_batches_on_the_gpu_equal_the_cpu():
    on_gpu, on_cpu = tensor_source_batches("cuda")[0], tensor_source_batches("cpu")[0]
    for (x_gpu, y_gpu), (x_cpu, y_cpu) in zip(on_gpu, on_cpu, strict=True):
        assert torch.equal(y_gpu, y_cpu)
        torch.testing.assert_close(x_gpu, x_cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a CPU never waits on a copy (its twin: test_preprocessing's mean-and-std test)")
def test_a_gpu_batch_after_the_first_makes_the_host_wait_for_nothing():
    """A blocking copy from the host (the normalisation's mean and std, the crop's flips) would
    make the host wait for every step queued before it: no trial of a group could overlap."""
    from dpsm_ray.data import TensorSource
    from dpsm_ray.data.augment import random_crop

    source = TensorSource(random_images(40), torch.arange(40) % 7, cifar100_transform).to("cuda")
    ids = [torch.tensor([3, 1, 4, 15, 9]).cuda(), torch.tensor([2, 6, 5]).cuda()]
    next(source.batches(ids[:1], augment=True, seed=5))  # the first batch copies the constants over
    torch.cuda.set_sync_debug_mode("error")
    try:
        for (x, _), batch_ids in zip(source.batches(ids, augment=True, seed=5), ids, strict=True):
            random_crop(x, batch_ids, 5, 2)  # the glyphs' shift: its no-flip mask is made on the device
    finally:
        torch.cuda.set_sync_debug_mode("default")
