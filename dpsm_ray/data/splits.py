"""Splits of a dataset (train / val / cal / test) and how batches are drawn from them.

A ``Split`` is a list of example ids into a shared ``source``.  Sources come in two kinds:
``TensorSource`` keeps every input in one tensor (small data, and 32x32 images as uint8 --
augmentation is then a batched tensor op, and the tensor can live on the GPU), ``FileSource``
decodes files through a torchvision dataset and a DataLoader.  The trainer only calls
``split.batches(index_batches, augment=..., seed=...)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dpsm_ray.data.preprocessing import InputSpec
from dpsm_ray.files import write_text

SPLIT_NAMES = ("train", "val", "cal", "test")


class TensorSource:
    """All inputs in one tensor ``[N, ...]`` (float features, or uint8 images ``[N, C, H, W]``).

    ``transform(x, ids, augment, seed)`` turns a raw batch into model input; it must draw any
    randomness from ``(seed, ids)`` so an example's augmentation does not depend on batching.
    """

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, transform: Callable | None = None) -> None:
        self.inputs = inputs
        self.labels = labels
        self.transform = transform

    def to(self, device: torch.device | str) -> TensorSource:
        return TensorSource(self.inputs.to(device), self.labels.to(device), self.transform)

    def batches(self, ids_batches: Sequence[torch.Tensor], *, augment: bool, seed: int) -> Iterator:
        for ids in on_device(ids_batches, self.inputs.device):
            x = self.inputs[ids]
            if self.transform is not None:
                x = self.transform(x, ids, augment, seed)
            yield x, self.labels[ids]


def on_device(ids_batches: Sequence[torch.Tensor], device: torch.device) -> Sequence[torch.Tensor]:
    """The batches' ids on ``device`` in one copy, not one per batch: a copy from the host blocks
    the host until the device has run what was queued before it (on a GPU, the previous step)."""
    if not ids_batches or all(ids.device == device for ids in ids_batches):
        return ids_batches
    sizes = [ids.numel() for ids in ids_batches]
    return torch.cat(list(ids_batches)).to(device).split(sizes)


class FileSource:
    """Inputs decoded from files: ``dataset[i]`` returns ``(PIL image, anything)``; the label is
    ``labels[i]`` (so a dataset's own targets can be remapped, e.g. to the Fungi species only).

    Augmented batches seed torch's RNG from ``(seed, example id)`` before each transform, so
    each example's augmentation is reproducible whatever the batching and worker count.
    ``num_workers`` DataLoader processes decode the files (0: in this process).
    """

    def __init__(self, dataset, labels: torch.Tensor, train_transform: Callable, eval_transform: Callable, num_workers: int = 4) -> None:
        self.dataset = dataset
        self.labels = labels
        self.train_transform = train_transform
        self.eval_transform = eval_transform
        self.num_workers = num_workers

    def batches(self, ids_batches: Sequence[torch.Tensor], *, augment: bool, seed: int) -> Iterator:
        view = _TransformedView(self, augment, seed)
        loader = torch.utils.data.DataLoader(
            view,
            batch_sampler=[ids.tolist() for ids in ids_batches],
            num_workers=self.num_workers,
            persistent_workers=False,
            # the loader draws its workers' base seed from this generator, not the global RNG;
            # the transforms ignore that seed (see _TransformedView)
            generator=torch.Generator(),
        )
        yield from loader


class _TransformedView(torch.utils.data.Dataset):
    def __init__(self, source: FileSource, augment: bool, seed: int) -> None:
        self.source, self.augment, self.seed = source, augment, seed

    def __len__(self) -> int:
        return len(self.source.labels)

    def __getitem__(self, index: int):
        from dpsm_ray.seeding import derive_seed

        image, _ = self.source.dataset[index]
        if self.augment:
            # torchvision's random transforms draw from torch's global RNG: seed a forked copy,
            # so that with num_workers=0 the caller's global RNG stream is left as it was
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.seed, index))
                x = self.source.train_transform(image)
        else:
            x = self.source.eval_transform(image)
        return x, int(self.source.labels[index])


@dataclass
class Split:
    """Examples ``ids`` (indices into ``source``) of one split."""

    name: str
    ids: torch.Tensor
    source: TensorSource | FileSource

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def labels(self) -> torch.Tensor:
        return self.source.labels[self.ids.to(self.source.labels.device)].cpu()

    @property
    def inputs(self) -> torch.Tensor:
        """The split's raw inputs ``[n, *shape]`` on the CPU, before any preparation: what a
        predictor takes (``Predictor.recalibrate(split.inputs, split.labels)``).  ValueError for a
        dataset read from image files as it trains (Caltech-101, iNaturalist): its inputs are files."""
        if not hasattr(self.source, "inputs"):
            raise ValueError(f"split {self.name}: its inputs are image files, read as training needs them; give a predictor the files "
                             "(dpsm-ray predict --input FOLDER), or read them as docs/predictor.md says")
        return self.source.inputs[self.ids.to(self.source.inputs.device)].cpu()

    def subset(self, positions: torch.Tensor, name: str | None = None) -> Split:
        return Split(name or self.name, self.ids[positions], self.source)

    def batches(self, index_batches: Sequence[torch.Tensor], *, augment: bool, seed: int) -> Iterator:
        """Batches ``(x, y)`` for lists of positions within this split."""
        return self.source.batches([self.ids[index] for index in index_batches], augment=augment, seed=seed)


@dataclass
class DataSplits:
    """The four splits of one dataset, with what a model needs to know about its inputs, and what
    a saved predictor needs to take new ones: how a raw input becomes a model input
    (``input_spec``) and the classes' names, where the dataset has them."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    train: Split
    val: Split
    cal: Split
    test: Split
    input_spec: InputSpec | None = None
    class_names: tuple[str, ...] | None = None

    def sizes(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in SPLIT_NAMES}

    def to(self, device: torch.device | str) -> DataSplits:
        """Move a tensor-backed dataset to ``device`` (a no-op for file-backed data)."""
        source = self.train.source
        if not isinstance(source, TensorSource):
            return self
        moved = source.to(device)
        splits = {name: getattr(self, name) for name in SPLIT_NAMES}
        return dataclasses.replace(self, **{name: Split(split.name, split.ids, moved) for name, split in splits.items()})

    def save(self, path: str | os.PathLike) -> None:
        """Write the example ids of every split as JSON (atomically), next to the results."""
        payload = {"dataset": self.name, "num_classes": self.num_classes, **{n: getattr(self, n).ids.tolist() for n in SPLIT_NAMES}}
        write_text(path, json.dumps(payload))


def stratified_partition(labels: torch.Tensor, sizes: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Disjoint random parts of ``range(len(labels))`` with the given sizes, each with (to within
    one example per class) the class proportions of the whole.

    Every example gets the key (rank within its shuffled class + a per-class random offset) /
    class count; cutting the examples sorted by key into consecutive runs gives stratified parts.
    """
    n = labels.numel()
    if sum(sizes) > n or min(sizes) < 0:
        raise ValueError(f"split sizes {list(sizes)} do not fit in {n} examples")
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen)
    shuffled = labels[order]
    by_class = shuffled.argsort(stable=True)
    sorted_labels = shuffled[by_class]
    counts = torch.bincount(sorted_labels)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n) - starts[sorted_labels]
    offset = torch.rand(counts.numel(), generator=gen, dtype=torch.float64)
    key = (rank.to(torch.float64) + offset[sorted_labels]) / counts[sorted_labels]
    stratified = order[by_class[key.argsort(stable=True)]]
    parts, start = [], 0
    for size in sizes:
        parts.append(stratified[start : start + size].sort().values)
        start += size
    return parts
