"""One card per dataset: its sizes, its loader, its default model, the files it needs.  A
researcher's folder or table is ``folder:PATH`` / ``table:FILE`` (``dpsm_ray.own_data``); a dataset
of their own code joins through ``register_dataset`` (docs/extending.md).

Known without importing torch: a built-in card names its loader as ``"module:function"``
(``_deferred``, through ``dpsm_ray.lazy.imported``), or holds a function importing it, run only when
a run loads the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from dpsm_ray import facts, own_data
from dpsm_ray.cards.models import model_names, registry as _registry
from dpsm_ray.cards.registry import register, seal
from dpsm_ray.lazy import imported


@dataclass(frozen=True)
class DatasetCard:
    """A dataset: ``--dataset NAME``, ``NAME:key=value,...`` where it has ``options``, or
    ``NAME:PATH[:key=value,...]`` where it takes a ``path`` (a researcher's folder or table).

    ``sizes(spec)``: the four splits' sizes, known without loading the data (a ValueError naming
    the bad option or file otherwise); ``load(spec, data_root=..., seed=..., download=...,
    data_workers=...)`` returns its ``dpsm_ray.data.DataSplits``; ``check_files(spec, data_root,
    download)`` raises FileNotFoundError naming a missing path (None: it needs no files) and does
    any one-time work (decoding into a cache): the driver runs it before anything starts.
    ``options``: the option names with their defaults (None: the name takes none).
    ``fingerprint(spec)``: a hash of the files it reads, for data that can change under the same
    name (a cached base model is keyed by it too).  ``pretrained_problem(spec, path)``: for a dataset
    cut for a pretrained backbone, why the weights at ``path`` are not that backbone, as far as the
    run that made them says (None: they fit, or no run's files sit beside them).
    """

    name: str
    title: str
    sizes: Callable[[str], dict[str, int]]
    load: Callable[..., Any]
    default_model: str
    check_files: Callable[[str, str | None, bool], Any] | None = None
    options: Mapping[str, float] | None = None
    path: bool = False
    fingerprint: Callable[[str], str] | None = None
    pretrained_problem: Callable[[str, str], str | None] | None = None


_DATASETS = _registry("dataset")


def register_dataset(card: DatasetCard, *, replace: bool = False) -> DatasetCard:
    """Make ``card``'s dataset known to validation, sweeps and the CLI in this process."""
    if card.default_model not in model_names():
        raise ValueError(
            f"dataset {card.name}: default_model must be a registered model ({', '.join(model_names())}); got {card.default_model!r}"
        )
    return register("dataset", card, replace)


def dataset_names() -> tuple[str, ...]:
    return tuple(_DATASETS)


def dataset_card(spec: str) -> DatasetCard:
    """The card of ``spec`` (``NAME`` or ``NAME:options``); ValueError naming the choices."""
    name = spec.partition(":")[0]
    if name not in _DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(_DATASETS)}; got {spec!r}")
    return _DATASETS[name]


def split_sizes(spec: str) -> dict[str, int]:
    """Sizes of the four splits of ``spec``, known without loading any data (for the image
    datasets, the paper's sizes: a smaller copy on disk gets them scaled down); ValueError naming
    the bad part of ``spec``."""
    card = dataset_card(spec)
    if card.options is None and not card.path and spec != card.name:
        takes = [name for name, other in _DATASETS.items() if other.options is not None and not other.path]
        paths = [f"{name}:PATH" for name, other in _DATASETS.items() if other.path]
        raise ValueError(
            f"dataset must be one of {', '.join(_DATASETS)} (only {', '.join(takes)} take options, and {', '.join(paths)} a path); got"
            f" {spec!r}"
        )
    return dict(card.sizes(spec))


def data_record(spec: str) -> dict:
    """What a results directory, a run and a predictor keep of the data of ``--dataset spec``: for a
    researcher's own folder or table, its files' record (``dpsm_ray.own_data.path_record``: content
    hashes, sizes, times), so that changed data at the same path is noticed; for a built-in dataset,
    its name and the dpsm_ray version that read it (its loader defines it)."""
    from dpsm_ray import __version__
    from dpsm_ray.own_data import path_record, split_path_spec

    card = dataset_card(spec)
    if card.path:
        return {"dataset": spec, **path_record(split_path_spec(spec)[1])}
    return {"dataset": spec, "kind": "built-in", "version": __version__}


def data_change(recorded: dict | None, spec: str) -> str | None:
    """How the data of ``--dataset spec`` now differs from ``recorded`` (its ``data_record`` when a
    result was made), in words; None when it is the same, or nothing was recorded."""
    from dpsm_ray.own_data import record_change

    if not recorded:
        return None
    return record_change(recorded, data_record(spec))


def check_dataset(spec: str) -> str:
    """``spec`` if it names a dataset with valid options; ValueError naming the bad part."""
    split_sizes(spec)
    return spec


def default_model(spec: str) -> str:
    """The model ``--model auto`` picks for ``spec``."""
    return dataset_card(spec).default_model


def pretrained_problem(spec: str, path: str) -> str | None:
    """Why the weights at ``path`` are not the backbone dataset ``spec`` is cut for (its card's
    ``pretrained_problem``); None where they fit, nothing says, or the dataset takes any weights."""
    card = dataset_card(spec)
    return card.pretrained_problem(spec, path) if card.pretrained_problem is not None else None


def check_data_present(spec: str, data_root: str | None = None, download: bool = False) -> None:
    """Raise ``FileNotFoundError`` (naming the expected path and ``--download``) if dataset
    ``spec`` needs files that are not under ``data_root``; the bundled and generated datasets
    always pass.  Reads no data: the CLI and the sweep call it before anything starts."""
    check_dataset(spec)
    card = dataset_card(spec)
    if card.check_files is not None:
        card.check_files(spec, data_root, download)


def load_splits(spec: str, data_root: str | None = None, *, seed: int, download: bool = False, data_workers: int = 4):
    """The four splits of dataset ``spec`` (its card's loader, a ``dpsm_ray.data.DataSplits``),
    stratified and disjoint, chosen by ``seed``.  The image datasets are read from (or, with
    ``download``, fetched into) ``data_root``; the fonts from the font files under it (default
    /usr/share/fonts); ``data_workers`` DataLoader processes decode the file-based ones."""
    check_dataset(spec)
    if not isinstance(data_workers, int) or isinstance(data_workers, bool) or data_workers < 0:
        raise ValueError(f"data_workers must be an integer >= 0; got {data_workers!r}")
    return dataset_card(spec).load(spec, data_root=data_root, seed=seed, download=download, data_workers=data_workers)


# -- the built-in datasets -------------------------------------------------------------------------
def _deferred(reference: str, *reads: str) -> Callable:
    """A card's loader or file check that imports ``reference`` (``"module:function"``) only when
    called -- the data modules import torch, the cards must not -- and calls it with ``reads``, the
    names of the call's own arguments (``spec``, ``data_root``, ``download``, ``seed``, ...) it takes."""

    def call(spec, data_root=None, download=False, **given):
        given.update(spec=spec, data_root=data_root, download=download)
        return imported(reference)(*(given[name] for name in reads))

    return call


def _fonts_transfer_backbone(spec, path):
    """What the run whose model.pt is at ``path`` trained on (its config.json beside it), against
    the backbone data ``spec`` is cut for; a bare weights file says nothing (None)."""
    import json

    config = Path(path).parent / "config.json"
    try:
        pretrained_on = json.loads(config.read_text()).get("dataset")
    except (OSError, ValueError, AttributeError):
        return None
    return facts.fonts_backbone_problem(spec, pretrained_on) if isinstance(pretrained_on, str) else None


def _load_image_dataset(spec, *, data_root, seed, download, data_workers):
    from dpsm_ray.data.vision import LOADERS

    return LOADERS[spec](data_root, seed, download, data_workers)


_fonts_present = _deferred("dpsm_ray.data.fonts:find_faces", "data_root")
_image_files_present = _deferred("dpsm_ray.data.vision:check_data_present", "spec", "data_root", "download")


def _paper_sizes(spec):
    return dict(facts.PAPER_SIZES[spec])


def _synthetic_sizes(spec):
    size = facts.parse_synthetic(spec)["size"]
    return {split: int(size * fraction) for split, fraction in facts.SYNTHETIC_FRACTIONS.items()}


for _card in (
    DatasetCard("digits", "scikit-learn's 8x8 digits", lambda spec: dict(facts.DIGITS_SIZES),
                _deferred("dpsm_ray.data.tabular:load_digits", "seed"), "mlp"),
    DatasetCard("synthetic", "Gaussian classes (generated)", _synthetic_sizes,
                _deferred("dpsm_ray.data.tabular:load_synthetic", "spec", "seed"), "mlp", options=facts.SYNTHETIC_DEFAULTS),
    DatasetCard(
        "glyphs",
        "procedural stroke glyphs (generated)",
        lambda spec: facts.glyph_sizes(facts.parse_glyphs(spec)),
        _deferred("dpsm_ray.data.glyphs:load_glyphs", "spec", "seed"),
        "lenet",
        options=facts.GLYPHS_DEFAULTS,
    ),
    DatasetCard(
        "fonts",
        "characters rendered from real typefaces",
        lambda spec: facts.font_sizes(facts.parse_fonts(spec)),
        _deferred("dpsm_ray.data.fonts:load_fonts", "spec", "data_root", "seed"),
        "lenet",
        check_files=_fonts_present,
        options=facts.FONTS_DEFAULTS,
    ),
    DatasetCard(
        "fonts_transfer",
        "few images of held-out typefaces, for a network pretrained on fonts (--pretrained-path)",
        lambda spec: facts.font_transfer_sizes(facts.parse_fonts_transfer(spec)),
        _deferred("dpsm_ray.data.fonts:load_fonts_transfer", "spec", "data_root", "seed"),
        "lenet",
        check_files=_fonts_present,
        options=facts.FONTS_TRANSFER_DEFAULTS,
        pretrained_problem=_fonts_transfer_backbone,
    ),
    *(DatasetCard(name, facts.IMAGE_TITLES[name], _paper_sizes, _load_image_dataset, model, check_files=_image_files_present)
      for name, model in (("fashion_mnist", "mlp_bn"), ("cifar100", "resnet110"), ("caltech101", "resnet50"), ("inaturalist", "resnet50"),
                          ("inaturalist2018", "resnet50"))),
    DatasetCard(
        "folder",
        "your images (an ImageFolder tree)",
        own_data.folder_sizes,
        _deferred("dpsm_ray.data.folder:load_folder", "spec", "seed"),
        "resnet20",
        check_files=_deferred("dpsm_ray.data.folder:check_folder", "spec"),
        options=own_data.FOLDER_DEFAULTS,
        path=True,
        fingerprint=own_data.folder_fingerprint,
    ),
    DatasetCard(
        "table",
        "your features (a Parquet, CSV or .npz table)",
        own_data.table_sizes,
        _deferred("dpsm_ray.data.table:load_table", "spec", "seed"),
        "mlp",
        check_files=lambda spec, data_root, download: own_data.table_sizes(spec),
        options=own_data.TABLE_DEFAULTS,
        path=True,
        fingerprint=own_data.table_fingerprint,
    ),
):
    register_dataset(_card)
seal("dataset")
