"""A trained conformal classifier, on disk and in memory: the thing a sweep is run for.

    from dpsm_ray import Predictor

    predictor = Predictor.load("results/digits/predictors/dpsm-seed0")
    probs = predictor.predict_proba(x)                        # softmax rows, [n, K] float64
    mask, sets = predictor.predict_sets(x, score="aps")       # boolean [n, K] and one list of classes per input
    mask, sets = predictor.predict_sets(x, calibration="class")  # a threshold per class: every class covered
    p = predictor.p_values(x, score="aps")                   # [n, K] conformal p-values: the set at alpha is p > alpha
    mine = predictor.recalibrate(x_cal, y_cal, alpha=0.05, by="class")  # your own data; class-conditional by default
    mine.save("my-predictor")

A predictor directory holds ``predictor.json`` (what the model is, how it takes inputs, and for each
score its calibrated threshold, a threshold per class and the calibration scores behind them; a
checksummed JSON file, ``dpsm_ray.files``) and ``weights.pt`` (a plain state dict, read with
``torch.load(weights_only=True)`` after its sha256 is checked): nothing in it is executed.
docs/predictor.md documents every field.

Prediction sets are split conformal's {y : S(x, y) <= q} (marginal) or {y : S(x, y) <= q_y}
(class-conditional, clustered; RC3P also limits y's rank) with the exact quantiles of ``dpsm_ray.conformal``; the randomised scores (APS,
RAPS, SAPS, top-k) draw one uniform per input from ``(uniform_seed, input id)`` exactly as the
sweep's evaluation does, so an input's set does not depend on its batch.

Imports torch, ``dpsm_ray.conformal``, ``dpsm_ray.models`` and ``dpsm_ray.data``: no Ray, no pandas.
"""

from __future__ import annotations

import copy
import math
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    import numpy as np

from dpsm_ray import __version__
from dpsm_ray.cards import check_score, model_card, model_choices, score_card, score_matrix, score_names
from dpsm_ray.conformal import (
    CALIBRATION_TITLES, SET_RULES, check_alpha, class_conformal_p_values, class_conformal_quantile, class_counts,
    class_coverage_range, class_prediction_sets, classes_under, clustered_calibration, conformal_p_values, conformal_quantile, coverage,
    empty_rate, example_uniforms, label_ranks, label_scores, min_calibration_size, rank_sets, rc3p_calibration, set_size,
    singleton_rate, top_label_ece,
)
from dpsm_ray.conformal.risk import check_costs, check_level, crc_threshold
from dpsm_ray.data.preprocessing import InputSpec
from dpsm_ray.files import CorruptFileError, atomic_write, read_checked_json, sha256_file, write_checked_json
from dpsm_ray.seeding import counter_uniforms, derive_seed

FORMAT = "dpsm_ray predictor"
# 2: its sets are class-conditional unless asked otherwise (a version that knows only 1 would give
# marginal sets without a word, so it refuses these); a marginal predictor is still written as 1.
# 3: clustered or RC3P sets unless asked otherwise
FORMAT_VERSION = 3
_CALIBRATION_FORMATS = {"marginal": 1, "class": 2, "cluster": 3, "rc3p": 3, "risk": 3}

INFO_FILE = "predictor.json"
WEIGHTS_FILE = "weights.pt"
# the chunks of the sweep's evaluation (train.loop.EVAL_BATCH): the same forward passes give the
# same probabilities, to the last bit, as the rows of evals.parquet were computed from
PREDICT_BATCH = 256
PRECISIONS = ("fp32", "bf16")
# How a predictor of a model trained elsewhere prepares raw inputs (``from_model``, ``dpsm-ray calibrate
# --prepare``): ``card``, as the dataset's card does for every model dpsm-ray trains (input.divisor,
# mean and std); ``none``, the inputs as they are (float32), as MAPIE and TorchCP hand a model its inputs
_PREPARATIONS = ("none", "card")
_INFO_FIELDS = (
    "format",
    "format_version",
    "package_version",
    "model",
    "input",
    "class_names",
    "method",
    "seed",
    "run_id",
    "training_config",
    "alpha",
    "uniform_seed",
    "scores",
    "calibration",
    "test",
    "weights",
    "provenance",
)


class PredictorError(ValueError):
    """A predictor directory that cannot be used; the message is one line naming the file and field."""


class InputError(ValueError):
    """Inputs (or labels, or ids) a predictor cannot take; the message names the expected shape or type."""


class PredictionSets(NamedTuple):
    mask: torch.Tensor  # [n, K] bool: class k is in input i's set
    lists: list[list[int]]  # the classes of each set, ascending


def pick_device(name: str) -> torch.device:
    """``auto`` (the GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for, but torch sees no CUDA device")
    return torch.device(name)


class Predictor:
    """A model, how it takes raw inputs (``InputSpec``), and a calibrated threshold per score.

    Build one with ``Predictor.load`` (a directory) or ``Predictor.create`` (a model in memory,
    then ``recalibrate``).  Predictors are immutable: ``recalibrate`` returns a new one sharing
    the model's weights."""

    def __init__(self, model: torch.nn.Module, info: dict, *, device: str | torch.device = "auto") -> None:
        _check_info(info, "predictor")
        self.info = info
        self.input_spec = InputSpec.from_json(info["input"])
        self.device = pick_device(device) if isinstance(device, str) else device
        self.model = model.to(self.device).eval()
        self._warned_positional = False  # _raw_inputs' warning, once

    # ------------------------------------------------------------------ construction and files

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        *,
        architecture: str,
        input_spec: InputSpec,
        num_classes: int,
        alpha: float,
        class_names=None,
        feature_names=None,
        label_column: str | None = None,
        uniform_seed: int = 0,
        precision: str = "fp32",
        method: str | None = None,
        seed: int | None = None,
        run_id: str | None = None,
        training_config: dict | None = None,
        provenance: dict | None = None,
        device: str | torch.device = "auto",
        input_preparation: dict | None = None,
    ) -> Predictor:
        """An uncalibrated predictor around ``model`` (which must be ``architecture`` built by
        ``dpsm_ray.cards.build_model`` for ``input_spec.shape``): ``recalibrate`` it before
        asking for sets.  ``feature_names``: the training table's feature columns, in the model's
        order, so that tables and JSON objects of new inputs are read by name; ``label_column``: its
        label column, which ``predict`` reads as labels where a table of new inputs holds it."""
        info = {
            "format": FORMAT, "format_version": 1, "package_version": __version__,
            "model": {"architecture": architecture, "num_classes": num_classes, "precision": precision},
            "input": input_spec.to_json(), "class_names": list(class_names) if class_names is not None else None,
            "method": method, "seed": seed, "run_id": run_id, "training_config": training_config,
            "alpha": check_alpha(alpha), "uniform_seed": uniform_seed, "scores": {}, "calibration": None, "test": None,
            "weights": {"file": WEIGHTS_FILE, "sha256": None}, "provenance": provenance or {},
        }
        if feature_names is not None:
            info["feature_names"] = [str(name) for name in feature_names]
        if label_column is not None:
            info["label_column"] = str(label_column)
        if input_preparation is not None:
            info["input_preparation"] = input_preparation
        return cls(model, info, device=device)

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, *, architecture: str, dataset: str, alpha: float = 0.1, seed: int = 0, data_root: str | None = None,
        precision: str = "fp32", provenance: dict | None = None, device: str | torch.device = "auto", data=None, prepare: str = "none",
    ) -> Predictor:
        """An uncalibrated predictor around a model trained elsewhere; ``architecture`` names what
        builds it (a model card, or ``PKG.MODULE:FACTORY``) so that a saved predictor can rebuild it,
        and ``model`` must be that network (its parameters' names and shapes are checked).
        ``prepare`` says what the model takes: ``none`` (default), raw inputs as they are -- what a
        model trained in plain PyTorch on the data's raw values takes, as MAPIE and TorchCP pass
        them; ``card``, inputs prepared as the card of ``dataset`` prepares them for every model
        dpsm-ray trains (``dpsm_ray.cards.load_splits(dataset, seed=seed)``).  The dataset gives
        the input description, the classes' names and, for a table, the feature names;
        ``recalibrate`` it on labelled points the model never trained on before asking for sets
        (``dpsm-ray calibrate`` does both from a weights file).  ValueError naming the model when
        it is not ``architecture`` or does not map the dataset's inputs to one logit per class.
        ``data``: those splits, when already loaded."""
        from dpsm_ray.cards import check_outputs, load_splits

        if prepare not in _PREPARATIONS:
            raise ValueError(f"prepare must be one of {', '.join(_PREPARATIONS)}; got {prepare!r}")
        data = data if data is not None else load_splits(dataset, data_root, seed=seed)
        if data.input_spec is None:
            raise ValueError(f"dataset {dataset} does not describe its inputs (DataSplits.input_spec): it cannot back a predictor")
        _check_architecture(model, architecture, data.num_classes, data.input_shape)
        check_outputs(model, architecture, data.input_shape, data.num_classes)
        spec = data.input_spec if prepare == "card" else _unprepared(data.input_spec)
        return cls.create(
            model, architecture=architecture, input_spec=spec, num_classes=data.num_classes, alpha=alpha,
            class_names=data.class_names, **table_columns(dataset), uniform_seed=seed, precision=precision, provenance=provenance,
            device=device, input_preparation={"how": prepare, "card": data.input_spec.to_json()},
        )

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device = "auto", trust_code: bool = False) -> Predictor:
        """The predictor in directory ``path``.  Refuses, with ``PredictorError`` naming the file:
        a missing file, a ``predictor.json`` changed after it was written or of a newer format,
        and weights whose sha256 differs from the recorded one (checked before they are read).
        A model that is a researcher's own factory (``PKG.MODULE:FACTORY``) is code a predictor
        names and loading would run: only with ``trust_code``."""
        from dpsm_ray.cards import build_model, is_factory

        directory = Path(path)
        info_path = directory / INFO_FILE
        if not directory.is_dir():
            raise PredictorError(f"{directory} is not a predictor directory: no such directory")
        if not info_path.is_file():
            from dpsm_ray.storage.layout import SWEEP_FILE

            if (directory / SWEEP_FILE).is_file():
                raise PredictorError(f"{directory} is a sweep's results directory, not a predictor: its final models are predictors under "
                                     f"{directory / 'predictors'}/ (e.g. METHOD-seed0), and dpsm-ray export {directory} --method METHOD "
                                     "--out DIR copies the one chosen on validation data out")
            if (directory / "predictor" / INFO_FILE).is_file():
                raise PredictorError(f"{directory} is a training run's --out, not a predictor: its predictor is {directory / 'predictor'}")
            raise PredictorError(f"{info_path} is missing: a predictor directory holds {INFO_FILE} and {WEIGHTS_FILE}")
        try:
            info = read_checked_json(info_path)
        except CorruptFileError as error:
            raise PredictorError(str(error)) from None
        _check_info(info, str(info_path))
        architecture = info["model"]["architecture"]
        if is_factory(architecture) and not trust_code:
            raise PredictorError(f"{info_path}: its model, {architecture}, is code to import and run; load it with trust_code=True "
                                 "(dpsm-ray predict/serve --trust-code) only if you trust where this predictor came from")
        weights = directory / info["weights"]["file"]
        if not weights.is_file():
            raise PredictorError(f"{weights} is missing (named by {info_path}, field weights.file)")
        if sha256_file(weights) != info["weights"]["sha256"]:
            raise PredictorError(
                f"{weights} does not match the sha256 recorded in {info_path} (weights.sha256): it changed after the predictor was written"
            )
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as error:  # an unpickling refusal or a truncated archive: either way unusable
            raise PredictorError(f"{weights} is not a state dict of tensors ({str(error).splitlines()[0][:160]})") from None
        spec = info["model"]
        model = build_model(spec["architecture"], spec["num_classes"], input_shape=tuple(info["input"]["shape"]))
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as error:
            raise PredictorError(f"{weights} does not hold the weights of a {spec['architecture']} with {spec['num_classes']} classes "
                                 f"({str(error).splitlines()[0][:160]})") from None
        return cls(model, info, device=device)

    def save(self, path: str | os.PathLike, *, provenance: dict | None = None, overwrite: bool = False) -> Path:
        """Write this predictor into directory ``path`` (created): ``weights.pt`` first, then
        ``predictor.json`` with its sha256, so a directory with a ``predictor.json`` is always whole
        (a write cut short leaves weights the sha256 in predictor.json refuses).  A predictor already there is
        replaced only with ``overwrite``; otherwise ``PredictorError``.  ``provenance`` is merged
        into predictor.json's."""
        directory = Path(path)
        if (directory / INFO_FILE).exists() and not overwrite:
            raise PredictorError(
                f"{directory} holds a predictor already; remove it, choose another directory, or save(..., overwrite=True)"
            )
        state = {name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()}
        atomic_write(directory / WEIGHTS_FILE, lambda handle: torch.save(state, handle))
        info = copy.deepcopy(self.info)
        info["weights"] = {"file": WEIGHTS_FILE, "sha256": sha256_file(directory / WEIGHTS_FILE)}
        info["provenance"] = {**info["provenance"], **(provenance or {})}
        write_checked_json(directory / INFO_FILE, info)
        return directory

    # ------------------------------------------------------------------ what it is

    @property
    def alpha(self) -> float:
        return self.info["alpha"]

    @property
    def input_preparation(self) -> str:
        """``card`` (raw inputs prepared as the dataset's card does: every model dpsm-ray trains) or
        ``none`` (passed to the model as they are): how ``from_model`` / ``dpsm-ray calibrate
        --prepare`` made it; ``card`` for every other predictor."""
        return (self.info.get("input_preparation") or {}).get("how", "card")

    def _prepared(self, how: str) -> Predictor:
        """This predictor with its inputs prepared ``how`` (``_PREPARATIONS``): the dataset card's
        preparation, or none; only for a predictor made from a model trained elsewhere."""
        if how not in _PREPARATIONS:
            raise ValueError(f"prepare must be one of {', '.join(_PREPARATIONS)}; got {how!r}")
        recorded = self.info.get("input_preparation")
        if recorded is None:
            raise PredictorError("this predictor records no other input preparation (only one made with from_model or dpsm-ray calibrate)")
        card = InputSpec.from_json(recorded["card"])
        info = copy.deepcopy(self.info)
        info["input"] = (card if how == "card" else _unprepared(card)).to_json()
        info["input_preparation"] = {**recorded, "how": how}
        return Predictor(self.model, info, device=self.device)

    def preparation_warning(self, raw: torch.Tensor, labels: torch.Tensor, probs: torch.Tensor, flag: str = "prepare=") -> str | None:
        """For a model trained elsewhere: a warning when its accuracy on labelled raw inputs (their
        probabilities ``probs``, as this predictor prepares them) is far below its accuracy with the
        other preparation -- the model was trained on inputs prepared that way -- else None.  Far:
        by at least 0.1, and by three standard errors of an accuracy on these points, so that a
        difference the points could give by chance is not named."""
        if "input_preparation" not in self.info or not len(labels):
            return None
        how = self.input_preparation
        other = "card" if how == "none" else "none"
        accuracy = float((probs.argmax(dim=1) == labels).double().mean())
        theirs = float((self._prepared(other).ordered_proba(raw).argmax(dim=1) == labels).double().mean())
        if theirs - accuracy < max(0.1, 3 * math.sqrt(0.25 / len(labels))):
            return None
        return (f"warning: the model's accuracy on the {len(labels)} calibration points is {accuracy:.3f} with its inputs "
                f"{_PREPARED[how]} ({flag}{how}), but {theirs:.3f} with them {_PREPARED[other]} ({flag}{other}): it was trained on inputs "
                f"prepared that way; calibrate again with {flag}{other}")

    @property
    def num_classes(self) -> int:
        return self.info["model"]["num_classes"]

    @property
    def class_names(self) -> list[str] | None:
        return self.info["class_names"]

    @property
    def feature_names(self) -> tuple[str, ...] | None:
        """The feature columns of the table the model trained on, in the model's order (None for
        other data, and for predictors written before names were recorded): tables and JSON
        objects of new inputs are matched to them by name, in any order."""
        names = self.info.get("feature_names")
        return tuple(names) if names is not None else None

    def _feature_order(self, columns, where: str) -> list[str]:
        """The names among ``columns`` in the model's order; ``InputError`` naming the missing and
        the unexpected ones (``where``: what the columns are, for the message)."""
        names, given = self.feature_names, list(columns)
        missing = [name for name in names if name not in given]
        extra = [name for name in given if name not in names]
        if missing or extra:
            parts = [f"{what} {len(names)} ({', '.join(map(repr, names[:20]))}{', ...' if len(names) > 20 else ''})"
                     for what, names in (("missing", missing), ("unexpected", extra)) if names]
            raise InputError(f"{where}: the predictor takes the {len(names)} features it trained on, by name; {' and '.join(parts)}")
        return list(names)

    def named_inputs(self, records) -> np.ndarray:
        """Inputs given as one mapping per input, ``{feature name: number}`` in any order, as a float64
        array ``[n, F]`` in the model's order.  ``InputError`` for a predictor without feature names,
        a record that is not a mapping, missing or unexpected names, or a value that is not a number."""
        import numpy as np

        if self.feature_names is None:
            raise InputError("this predictor has no feature names (it did not train on a table with named columns): give each input as "
                             "an array of numbers")
        rows = []
        for position, record in enumerate(records):
            if not isinstance(record, dict):
                raise InputError(f"input {position} is {type(record).__name__}; give every input as an object of feature names, or every "
                                 "input as an array")
            order = self._feature_order(record, f"input {position}")
            values = [record[name] for name in order]
            wrong = next((name for name, v in zip(order, values) if isinstance(v, bool) or not isinstance(v, (int, float))), None)
            if wrong is not None:
                raise InputError(f"input {position}: feature {wrong!r} is {record[wrong]!r}, not a number")
            rows.append(values)
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(self.feature_names))

    @property
    def label_column(self) -> str | None:
        """The label column of the table the model trained on (``table:FILE``), which a table of
        new inputs in the same layout may hold (``predict`` reads it as labels); None for other data."""
        from dpsm_ray.own_data import parse_table

        if "label_column" in self.info:
            return self.info["label_column"]
        dataset = (self.info["training_config"] or {}).get("dataset", "")  # predictors written before label_column was recorded
        return parse_table(dataset)[1]["label"] if dataset.startswith("table:") else None

    def _label_indices(self, y) -> torch.Tensor:
        """Labels as class indices ``[n]`` int64: integers in 0..K-1, or the classes' names
        (``class_names``; a table's label values as text), e.g. a DataFrame's label column."""
        if hasattr(y, "to_numpy") and type(y).__module__.split(".")[0] in ("pandas", "pyarrow"):
            y = y.to_numpy()
        import numpy as np

        values = np.asarray(y) if not isinstance(y, torch.Tensor) else None
        if values is None or values.dtype.kind in "iufb" or (values.dtype.kind == "O" and all(
                isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values.ravel())):
            return check_labels(y, self.num_classes)
        names = self.class_names
        if names is None:
            raise InputError(f"labels must be class indices 0..{self.num_classes - 1}: this predictor has no class names to read "
                             f"{values.ravel()[0]!r} by")
        index = {name: k for k, name in enumerate(names)}
        if values.ndim != 1:
            raise InputError(f"labels must be one class per input, shape [n]; got {list(values.shape)}")
        unknown = next((v for v in values.tolist() if str(v) not in index), None)
        if unknown is not None or any(v is None for v in values.tolist()):
            listed = f"{', '.join(names[:10])}{', ...' if len(names) > 10 else ''}"
            raise InputError(f"label {unknown!r} is not a class of this predictor ({listed})")
        return torch.tensor([index[str(v)] for v in values.tolist()], dtype=torch.int64)

    @property
    def uniform_seed(self) -> int:
        return self.info["uniform_seed"]

    @property
    def thresholds(self) -> dict[str, float]:
        """The calibrated (marginal) threshold q of each score (``inf``: too few calibration points,
        every set holds every class)."""
        return {kind: _threshold(entry["threshold"]) for kind, entry in self.info["scores"].items()}

    @property
    def calibrated_by(self) -> str:
        """The calibration its sets use unless asked otherwise: ``marginal`` (one threshold per
        score), ``class`` (one per score and class; ``recalibrate(..., by="class")``), ``cluster`` or
        ``rc3p``."""
        return (self.info["calibration"] or {}).get("by", "marginal")

    def class_thresholds(self, score: str) -> torch.Tensor:
        """The threshold q_y of each class for ``score``, ``[K]`` float64 (``inf``: a class with too
        few calibration points for alpha, which every class-conditional set holds)."""
        return self.set_thresholds(score, "class")[0]

    def set_thresholds(self, score: str, calibration: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``score``'s sets of ``calibration`` (None: the predictor's own) hold y by: the
        threshold of each class ``[K]`` float64 (the marginal q repeated; ``inf``: every set holds the
        class) and RC3P's limit on y's rank among the probabilities ``[K]`` int64 (None for the
        others): the set is {y : S(x, y) <= q_y and rank(x, y) <= k_y}."""
        how = self.calibration_of(calibration)
        if how == "marginal":
            values = [self._calibrated_entry(score)["threshold"]] * self.num_classes
        elif how == "risk":
            values = [self._recorded(score, "risk_threshold", "this predictor has no risk control; control_risk(x_cal, y_cal, costs, "
                                                            "level) gives it")] * self.num_classes
        else:
            before = "class-conditional calibration" if how == "class" else "that calibration"
            values = self._recorded(score, f"{how}_thresholds", f"this predictor records no {how} thresholds (written before {before}); "
                                                              f"recalibrate(x_cal, y_cal, by={how!r}) gives them")
        limits = self._calibrated_entry(score)["rc3p_rank_limits"] if how == "rc3p" else None
        return (torch.tensor([_threshold(q) for q in values], dtype=torch.float64),
                None if limits is None else torch.tensor(limits, dtype=torch.int64))

    def _recorded(self, score: str, key: str, lacking: str):
        """``key`` of ``score``'s calibration record; ``lacking``, the error, where this predictor has none."""
        entry = self._calibrated_entry(score)
        if key not in entry:
            raise PredictorError(lacking)
        return entry[key]

    def fallback_classes(self, score: str) -> list[int]:
        """The classes with too few calibration points for a finite class-conditional threshold at
        alpha: every class-conditional set holds them (the conservative fallback)."""
        return torch.isinf(self.class_thresholds(score)).nonzero().flatten().tolist()

    def __repr__(self) -> str:
        model = self.info["model"]
        where = f", run {self.info['run_id']}" if self.info["run_id"] else ""
        thresholds = ", ".join(f"{kind} q={q:.4g}" for kind, q in self.thresholds.items()) or "uncalibrated"
        by = f", {CALIBRATION_TITLES[self.calibrated_by]} sets" if self.calibrated_by != "marginal" else ""
        return f"Predictor({model['architecture']}, {model['num_classes']} classes, alpha={self.alpha:g}, {thresholds}{by}{where})"

    # ------------------------------------------------------------------ predicting

    def check_inputs(self, x) -> torch.Tensor:
        """``x`` as a CPU tensor ``[n, *shape]`` of its own real dtype; ``InputError`` naming the
        expected shape otherwise (a flat ``[n, features]`` is reshaped, and greyscale images
        ``[n, H, W]`` get their one channel)."""
        shape = self.input_spec.shape
        greyscale = len(shape) == 3 and shape[0] == 1
        others = ([f"[n, {shape[1]}, {shape[2]}]"] if greyscale else []) + (
            [f"[n, {self.input_spec.features}] flattened"] if len(shape) > 1 else []
        )
        expected = f"[n, {', '.join(map(str, shape))}]" + (f" (or {', or '.join(others)})" if others else "")
        tensor = _as_number_tensor(x, "inputs")
        if tensor.ndim >= 1 and tuple(tensor.shape[1:]) == shape:
            pass
        elif greyscale and tensor.ndim == 3 and tuple(tensor.shape[1:]) == shape[1:]:
            tensor = tensor.unsqueeze(1)  # e.g. scikit-learn's load_digits().images, [n, 8, 8]
        elif tensor.ndim == 2 and tensor.shape[1] == self.input_spec.features:
            tensor = tensor.reshape(-1, *shape)
        else:
            hint = ""
            if tensor.ndim == len(shape) + 1 and len(shape) == 3 and tuple(tensor.shape[1:]) == (shape[1], shape[2], shape[0]):
                hint = ": channels last? move the channels first (x.transpose(0, 3, 1, 2))"
            elif tensor.ndim == len(shape) + 1 and len(shape) == 3 and tensor.shape[1] != shape[0]:
                hint = f": {tensor.shape[1]} channels where the model takes {shape[0]}"
            raise InputError(f"inputs must have shape {expected}; got {list(tensor.shape)}{hint}")
        if tensor.is_floating_point():
            bad = ~torch.isfinite(tensor.flatten(1)).all(dim=1)
            if bad.any():
                raise InputError(
                    f"inputs hold NaN or infinite values ({int(bad.sum())} inputs, the first at position {int(bad.nonzero()[0])})"
                )
        return tensor

    def _raw_inputs(self, x) -> torch.Tensor:
        """``x`` as raw inputs in the model's order (``check_inputs``).  Named columns -- a pandas
        DataFrame, a pyarrow Table, or a dict of column name to values -- are matched to the
        predictor's ``feature_names`` by name, in any order (the training table's label column, if
        there, is left out; a missing or unexpected column is refused, naming it); a predictor
        without names takes them in their order.  An array is read by position: for a predictor
        with names, a warning (once per predictor) says in which order."""
        columns = _named_columns(x)
        if columns is not None:
            if self.feature_names is None:
                return self.check_inputs(stacked(columns, list(columns)))
            given = [name for name in columns if name != self.label_column]
            return self.check_inputs(stacked(columns, self._feature_order(given, "the named columns")))
        if self.feature_names is not None and not self._warned_positional:
            self._warned_positional = True
            names = self.feature_names
            warnings.warn(
                f"this predictor reads {len(names)} named features ({', '.join(names[:6])}{', ...' * (len(names) > 6)}); an array is "
                "taken by position in that order: pass a DataFrame, a pyarrow Table or a dict of columns to match them by name",
                stacklevel=_caller_level(),
            )
        return self.check_inputs(x)

    def predict_proba(self, x, *, batch_size: int = PREDICT_BATCH, progress=None) -> torch.Tensor:
        """Softmax probabilities ``[n, K]`` (float64, CPU) of raw inputs ``x`` (numpy or torch,
        ``[n, *shape]``, or named columns: ``_raw_inputs``), computed in chunks of ``batch_size`` on
        the predictor's device.  ``progress(done)`` is called after each chunk."""
        return self.ordered_proba(self._raw_inputs(x), batch_size=batch_size, progress=progress)

    @torch.no_grad()
    def ordered_proba(self, x, *, batch_size: int = PREDICT_BATCH, progress=None) -> torch.Tensor:
        """``predict_proba`` of inputs already in the model's order (``predict`` and ``serve`` match
        names first): no name matching, no warning."""
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size must be an integer >= 1; got {batch_size!r}")
        inputs = self.check_inputs(x)
        logits = []
        for start in range(0, len(inputs), batch_size):
            logits.append(self.logits(inputs[start : start + batch_size]))
            if progress is not None:
                progress(min(start + batch_size, len(inputs)))
        if not logits:
            return torch.empty(0, self.num_classes, dtype=torch.float64)
        return torch.cat(logits).double().softmax(dim=1)

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The model's float32 logits (CPU) of one chunk of checked raw inputs, as the sweep's
        evaluation computes them: preprocessing, eval mode, the run's precision."""
        x = self.input_spec.apply(raw.to(self.device, non_blocking=True))
        if self.info["model"]["precision"] == "bf16":
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                return self.model(x).float().cpu()
        return self.model(x).float().cpu()

    def predict_sets(
        self, x, score: str = "hps", *, calibration: str | None = None, example_ids=None, batch_size: int = PREDICT_BATCH,
        non_empty: bool = False,
    ) -> PredictionSets:
        """The prediction set of each raw input: a boolean ``[n, K]`` mask and the lists of its
        classes.  ``calibration``: ``marginal`` ({y : S(x, y) <= q}), ``class`` ({y : S(x, y) <=
        q_y}, every class covered at 1 - alpha) or None, the predictor's own (``calibrated_by``).
        ``example_ids`` (default ``0 .. n-1``) draw the randomised scores' uniforms: pass stable ids
        (e.g. dataset indices) for sets that do not depend on an input's position.

        A set may be empty: no class scores within the threshold, which split conformal allows (an
        input unlike the calibration data; at alpha 0.1 an accurate model leaves some sets empty,
        and those count as misses in the guaranteed coverage).  ``non_empty=True`` puts the top
        class into every empty set: the sets only grow, so coverage stays at least 1 - alpha
        (conservative), at the price of sets a little larger than the guarantee needs.

        The mask is a torch tensor for torch inputs, a numpy array otherwise."""
        probs = self.predict_proba(x, batch_size=batch_size)
        sets = self.sets_from_proba(probs, score, calibration=calibration, example_ids=example_ids, non_empty=non_empty)
        if _numpy_out(x):
            return PredictionSets(sets.mask.numpy(), sets.lists)
        return sets

    def sets_from_proba(
        self, probs: torch.Tensor, score: str = "hps", *, calibration: str | None = None, example_ids=None, non_empty: bool = False
    ) -> PredictionSets:
        """``predict_sets`` from probabilities already computed with ``predict_proba``."""
        scores = self.score_matrix(probs, score, example_ids)
        thresholds, rank_limits = self.set_thresholds(score, calibration)
        if rank_limits is None:
            mask = class_prediction_sets(scores, thresholds)
        else:
            mask = rank_sets(scores, thresholds, label_ranks(probs), rank_limits)
        if non_empty:
            empty = ~mask.any(dim=1)
            mask[empty, probs[empty].argmax(dim=1)] = True
        return PredictionSets(mask, _mask_lists(mask))

    def p_values(
        self, x, score: str = "hps", *, calibration: str | None = None, example_ids=None, smoothed: bool = False,
        batch_size: int = PREDICT_BATCH,
    ):
        """The conformal p-value of every class for each raw input, ``[n, K]`` float64 (numpy for
        numpy inputs): ``(1 + #{calibration scores >= S(x, y)}) / (n + 1)``, against every
        calibration point (``marginal``) or those of class y (``class``), with the uniforms of the
        sets.  The set at any alpha' is {y : p_y > alpha'}: at the predictor's alpha, exactly
        ``predict_sets``'s (``dpsm_ray.conformal.pvalues``).  ``smoothed``: the smoothed p-value,
        ties and the +1 weighted by a second uniform per input (from ``uniform_seed`` and the input's
        id), exactly uniform; its sets {p > alpha} are randomised and are not the threshold sets."""
        probs = self.predict_proba(x, batch_size=batch_size)
        values = self.p_values_from_proba(probs, score, calibration=calibration, example_ids=example_ids, smoothed=smoothed)
        return values.numpy() if _numpy_out(x) else values

    def p_values_from_proba(
        self, probs: torch.Tensor, score: str = "hps", *, calibration: str | None = None, example_ids=None, smoothed: bool = False
    ) -> torch.Tensor:
        """``p_values`` from probabilities already computed with ``predict_proba``."""
        how = self.calibration_of(calibration)
        if how not in ("marginal", "class"):
            raise PredictorError(f"p-values are defined for the marginal and class calibrations; {how} sets have no p-values here")
        per_class = self.calibration_scores(score)
        reference = torch.tensor([value for values in per_class for value in values], dtype=torch.float64)
        scores = self.score_matrix(probs, score, example_ids)
        tau = counter_uniforms(derive_seed(self.uniform_seed, "p-values"), check_ids(example_ids, len(probs))) if smoothed else None
        if how == "class":
            labels = torch.cat([torch.full((len(values),), label) for label, values in enumerate(per_class)])
            return class_conformal_p_values(reference, labels, scores, tau)
        return conformal_p_values(reference, scores, tau)

    def calibration_scores(self, score: str) -> list[list[float]]:
        """The label scores of the calibration points behind ``score``'s thresholds, one ascending
        list per class: what p-values are counted against."""
        return self._recorded(score, "calibration_scores", "this predictor records no calibration scores (written before p-values); "
                                                          "recalibrate(x_cal, y_cal) gives them")

    def check_request(self, score: str, calibration: str | None = None, p_values: bool = False) -> str:
        """The calibration sets of ``score`` will use (None: the predictor's own), once this predictor
        is known to hold what they and, with ``p_values``, its p-values need (``PredictorError``
        otherwise: ``predict`` and ``serve`` ask before reading any input)."""
        how = self.calibration_of(calibration)
        self.set_thresholds(score, how)
        if p_values and how not in ("marginal", "class"):
            raise PredictorError(f"p-values are defined for the marginal and class calibrations; {how} sets have no p-values here")
        if p_values:
            self.calibration_scores(score)
        return how

    def calibration_of(self, calibration: str | None) -> str:
        """``calibration`` checked (None: the predictor's own)."""
        if calibration is None:
            return self.calibrated_by
        if calibration not in SET_RULES:
            raise ValueError(f"calibration must be one of {', '.join(SET_RULES)}; got {calibration!r}")
        return calibration

    def _calibrated_entry(self, score: str) -> dict:
        """predictor.json's entry of a calibrated score (``PredictorError`` naming those there are)."""
        kind = check_score(score)
        if kind not in self.info["scores"]:
            have = ", ".join(self.info["scores"]) or "none"
            raise PredictorError(
                f"this predictor has no calibrated threshold for {kind} (it has: {have}); call recalibrate(x_cal, y_cal) first"
            )
        return self.info["scores"][kind]

    def threshold(self, score: str) -> float:
        """The marginal threshold q of ``score``."""
        return _threshold(self._calibrated_entry(score)["threshold"])

    def score_matrix(self, probs: torch.Tensor, score: str, example_ids=None) -> torch.Tensor:
        """S(x, y) of every class, ``[n, K]``, with the uniforms of ``example_ids``."""
        kind = check_score(score)
        if probs.ndim != 2 or probs.shape[1] != self.num_classes:
            raise InputError(f"probabilities must have shape [n, {self.num_classes}]; got {list(probs.shape)}")
        ids = check_ids(example_ids, len(probs))
        u = example_uniforms(self.uniform_seed, ids)
        return score_matrix(probs, kind, u=u if score_card(kind).randomised else None, parameters=self.score_parameters(kind))

    def score_parameters(self, kind: str) -> dict:
        """The score's own hyperparameters (RAPS's lambda and k_reg): as calibrated, else its card's."""
        entry = self.info["scores"].get(kind, {})
        return {name: entry.get(name, default) for name, default in score_card(kind).parameters.items()}

    # ------------------------------------------------------------------ calibrating

    def recalibrate(
        self, x_cal, y_cal, alpha: float | None = None, *, by: str = "marginal", example_ids=None, data: str | None = None
    ) -> Predictor:
        """A new predictor with the same model, calibrated on ``(x_cal, y_cal)`` at ``alpha``
        (default: this one's) for every score: q is ``dpsm_ray.conformal.conformal_quantile``, the
        ceil((n + 1)(1 - alpha))-th smallest calibration score, and q_y of each class the same
        quantile of that class's points alone (``class_conformal_quantile``); the clustered and RC3P
        thresholds (``dpsm_ray.conformal.classwise``: a threshold per cluster of alike classes; a
        threshold and a rank limit per class) too.  All are kept, with the calibration scores (for
        ``p_values``); ``by`` (``marginal``, ``class``, ``cluster`` or ``rc3p``) is the one its sets
        use unless asked otherwise.  Alpha outside (0, 1) raises the conformal core's
        ValueError; with fewer than 1/alpha - 1 points q is infinite, as there (every set holds
        every class), and a warning says so -- as it does, with ``by="class"``, naming each class
        with too few points (every set holds that class).  ``data`` describes the calibration data
        in predictor.json.

        The guarantee needs points the model never trained on, exchangeable with the inputs to come:
        on training points the model is more confident than on new ones, q comes out too small and
        coverage falls short (measured on digits: 0.944 at a 0.95 target)."""
        labels = self._label_indices(y_cal)
        raw = self._raw_inputs(x_cal)
        probs = self.ordered_proba(raw)
        if len(labels) != len(probs):
            raise InputError(f"y_cal must hold one label per input: {len(probs)} inputs, {len(labels)} labels")
        warning = self.preparation_warning(raw, labels, probs)
        if warning is not None:
            warnings.warn(warning.removeprefix("warning: "), stacklevel=2)
        return self.calibrated(probs, labels, self.alpha if alpha is None else alpha, by=by, example_ids=example_ids,
                               data=data or f"{len(labels)} points passed to Predictor.recalibrate")

    def control_risk(
        self, x_cal, y_cal, costs, level: float, *, alpha: float | None = None, example_ids=None, data: str | None = None
    ) -> Predictor:
        """A new predictor, calibrated on ``(x_cal, y_cal)`` as ``recalibrate`` does (at ``alpha``,
        default this one's), whose sets control the expected class-weighted miss cost at ``level``:
        ``costs`` gives each class's cost of a miss in [0, 1] (a list of K, or a dict of class names or
        indices, the others 0), and for every score lambda is conformal risk control's
        (``dpsm_ray.conformal.risk``), so that E[cost of Y if Y is not in C(X)] <= level on new points
        exchangeable with these.  Its sets are {y : S(x, y) <= lambda} unless asked otherwise
        (``calibration="risk"``)."""
        labels = self._label_indices(y_cal)
        probs = self.ordered_proba(self._raw_inputs(x_cal))
        if len(labels) != len(probs):
            raise InputError(f"y_cal must hold one label per input: {len(probs)} inputs, {len(labels)} labels")
        return self.calibrated_risk(probs, labels, self.class_costs(costs), level, self.alpha if alpha is None else alpha,
                                    example_ids=example_ids, data=data or f"{len(labels)} points passed to Predictor.control_risk")

    def class_costs(self, costs) -> torch.Tensor:
        """``costs`` as a ``[K]`` tensor: a sequence of K, or a mapping of class names or indices to
        costs (the classes it leaves out cost nothing)."""
        if isinstance(costs, dict):
            names, values = self.class_names or [], torch.zeros(self.num_classes, dtype=torch.float64)
            for key, value in costs.items():
                index = names.index(str(key)) if str(key) in names else key if isinstance(key, int) else None
                if index is None or not 0 <= index < self.num_classes:
                    raise InputError(f"costs: {key!r} is not a class of this predictor (a class name, or an index below "
                                     f"{self.num_classes})")
                values[index] = float(value)
            costs = values
        return check_costs(costs, self.num_classes)

    def calibrated_risk(
        self, probs: torch.Tensor, labels: torch.Tensor, costs: torch.Tensor, level: float, alpha: float, *, example_ids=None, data: str
    ) -> Predictor:
        """``control_risk`` from calibration probabilities already computed with this model."""
        check_level(level)
        calibrated = self.calibrated(probs, labels, alpha, example_ids=example_ids, data=data)
        info = calibrated.info
        for kind, entry in info["scores"].items():
            own = label_scores(self.score_matrix(probs, kind, example_ids), labels)
            entry["risk_threshold"] = _json_thresholds(torch.tensor([crc_threshold(own, labels, costs, level)]))[0]
        info["risk"] = {"costs": costs.tolist(), "level": level}
        info["calibration"]["by"] = "risk"
        info["format_version"] = _CALIBRATION_FORMATS["risk"]
        return calibrated

    def calibrated(
        self, probs: torch.Tensor, labels: torch.Tensor, alpha: float, *, by: str = "marginal", example_ids=None, data: str
    ) -> Predictor:
        """``recalibrate`` from calibration probabilities already computed with this model."""
        check_alpha(alpha)
        by = self.calibration_of(by)
        if by == "risk":
            raise ValueError("risk-controlled sets need each class's miss cost and a level: control_risk(x_cal, y_cal, costs, level)")
        labels = check_labels(labels, self.num_classes)
        scores = {}
        label_rank = label_ranks(probs).gather(1, labels[:, None]).squeeze(1)
        for kind in score_names():
            calibration_scores = label_scores(self.score_matrix(probs, kind, example_ids), labels)
            q = float(conformal_quantile(calibration_scores, alpha))
            class_q = class_conformal_quantile(calibration_scores, labels, self.num_classes, alpha)
            clustered = clustered_calibration(calibration_scores, labels, self.num_classes, alpha,
                                              seed=derive_seed(self.uniform_seed, "clusters"))
            ranked = rc3p_calibration(calibration_scores, label_rank, labels, self.num_classes, alpha)
            scores[kind] = {
                "threshold": q if math.isfinite(q) else None,
                "calibration_points": len(labels),
                "randomised": score_card(kind).randomised,
                **self.score_parameters(kind),
                "class_thresholds": _json_thresholds(class_q),
                "cluster_thresholds": _json_thresholds(clustered.thresholds),
                "clusters": clustered.clusters.tolist(),
                "rc3p_thresholds": _json_thresholds(ranked.thresholds),
                "rc3p_rank_limits": ranked.rank_limits.tolist(),
                "calibration_scores": [sorted(calibration_scores[labels == label].tolist()) for label in range(self.num_classes)],
            }
        need = min_calibration_size(alpha)
        if len(labels) < need:
            warnings.warn(
                f"alpha={alpha:g} needs at least {need} calibration points for a finite threshold; with"
                f" {len(labels)} every prediction set holds every class",
                stacklevel=3,
            )
        counts = class_counts(labels, self.num_classes).tolist()
        short = [label for label, count in enumerate(counts) if count < need]
        if by in ("class", "rc3p") and short and len(labels) >= need:
            names = self.class_names
            named = ", ".join(f"{label} ({names[label]!r}, {counts[label]})" if names else f"{label} ({counts[label]})"
                              for label in short[:20])
            warnings.warn(
                f"class-conditional calibration at alpha={alpha:g} needs at least {need} calibration points of a class; "
                f"{len(short)} class{'es have' if len(short) > 1 else ' has'} fewer -- {named}{', ...' if len(short) > 20 else ''}: "
                "every prediction set holds them (their thresholds are infinite)",
                stacklevel=3,
            )
        info = copy.deepcopy(self.info)
        accuracy = float((probs.argmax(dim=1) == labels).double().mean()) if len(labels) else None
        calibration = {"data": data, "points": len(labels), "by": by, "accuracy": accuracy}
        info.update(alpha=alpha, scores=scores, calibration=calibration, test=None,
                    format_version=_CALIBRATION_FORMATS[by])
        return Predictor(self.model, info, device=self.device)

    def measure(
        self, probs: torch.Tensor, labels: torch.Tensor, *, calibration: str | None = None, example_ids=None
    ) -> dict[str, dict[str, float]]:
        """Coverage and mean set size of every calibrated score on labelled probabilities, with its
        sets of ``calibration`` (None: the predictor's own), and the metrics of evals.parquet that
        follow from the sets alone (docs/results.md): the empty-set and singleton rates, the classes
        under 1 - alpha and the lowest and highest class coverage; and the ECE of the probabilities."""
        labels = check_labels(labels, self.num_classes)
        measured, ece = {}, float(top_label_ece(probs, labels))
        for kind in self.info["scores"]:
            mask = self.sets_from_proba(probs, kind, calibration=calibration, example_ids=example_ids).mask
            low, high = class_coverage_range(mask, labels)
            measured[kind] = {"coverage": float(coverage(mask, labels)), "set_size": float(set_size(mask)),
                              "empty_rate": float(empty_rate(mask)), "singleton_rate": float(singleton_rate(mask)),
                              "classes_under": int(classes_under(mask, labels, self.alpha)), "class_coverage_min": float(low),
                              "class_coverage_max": float(high), "ece": ece}
        return measured

    def evaluate(self, x, y, *, calibration: str | None = None, example_ids=None) -> dict[str, dict[str, float]]:
        """Coverage and mean set size of every calibrated score on labelled raw inputs."""
        return self.measure(self.predict_proba(x), self._label_indices(y), calibration=calibration, example_ids=example_ids)

    def with_test(self, measured: dict, points: int, data: str, accuracy: float | None = None) -> Predictor:
        """This predictor with ``measured`` (``measure``'s result on ``points`` test points,
        described by ``data``) and the top-1 ``accuracy`` there recorded as its test metrics."""
        info = copy.deepcopy(self.info)
        info["test"] = {"data": data, "points": points, "scores": measured, **({"accuracy": accuracy} if accuracy is not None else {})}
        return Predictor(self.model, info, device=self.device)


def _caller_level() -> int:
    """The ``stacklevel`` of a warning raised in the function that calls this, that names the first
    caller outside this module (a user's ``predict_sets`` or ``predict_proba`` alike)."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


_PREPARED = {"none": "passed as they are", "card": "standardised as the dataset's card prepares them"}


def _unprepared(spec: InputSpec) -> InputSpec:
    """``spec`` with its standardisation taken out: a raw input reaches the model as it is (float32)."""
    return InputSpec(spec.shape, 1.0, 0.0, 1.0, spec.raw, spec.image)


def _check_architecture(model: torch.nn.Module, architecture: str, num_classes: int, input_shape) -> None:
    """ValueError naming the first parameter or buffer where ``model`` is not ``architecture``
    (built by ``dpsm_ray.cards.build_model``) -- a missing or extra name, or another shape -- so
    that a saved predictor rebuilds the same network its weights fit."""
    from dpsm_ray.cards import build_model

    reference = {name: tuple(t.shape) for name, t in build_model(architecture, num_classes, input_shape=input_shape).state_dict().items()}
    mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [name for name in reference if name not in mine]
    extra = [name for name in mine if name not in reference]
    shaped = [name for name in reference if name in mine and mine[name] != reference[name]]
    if missing or extra or shaped:
        if shaped:
            what = f"{shaped[0]} has shape {list(mine[shaped[0]])} where {architecture} has {list(reference[shaped[0]])}"
        else:
            what = (f"it lacks {', '.join(missing[:3])}" if missing else "") + (" and " if missing and extra else "") + (
                f"has {', '.join(extra[:3])} that {architecture} has not" if extra else "")
        raise ValueError(f"model: not the network architecture={architecture!r} builds for {num_classes} classes ({what}); name what "
                         "builds yours (a PKG.MODULE:FACTORY of your code, or a model card)")


def _numpy_out(x) -> bool:
    """Whether results for inputs ``x`` are numpy arrays: for numpy, pandas, pyarrow and dict
    inputs (torch tensors and lists give torch tensors)."""
    from collections.abc import Mapping

    return type(x).__module__.split(".")[0] in ("numpy", "pandas", "pyarrow") or isinstance(x, Mapping)


def _named_columns(x) -> dict | None:
    """Named inputs as ``{column name: 1-D numpy array}``: a pandas DataFrame, a pyarrow Table or
    a dict of columns; None for anything else (arrays, tensors, lists)."""
    from collections.abc import Mapping

    import numpy as np

    root = type(x).__module__.split(".")[0]
    if root == "pandas" and hasattr(x, "columns") and hasattr(x, "iloc"):
        names = [str(name) for name in x.columns]
        if len(set(names)) != len(names):
            raise InputError(f"the DataFrame's columns repeat a name ({next(n for n in names if names.count(n) > 1)!r}): each feature once")
        return {name: x.iloc[:, i].to_numpy() for i, name in enumerate(names)}
    if root == "pyarrow" and hasattr(x, "column_names"):
        return {str(name): x.column(name).to_numpy() for name in x.column_names}
    if isinstance(x, Mapping):
        return {str(name): np.asarray(values) for name, values in x.items()}
    return None


def stacked(columns: dict, order: list[str]):
    """The ``order`` columns of ``columns`` side by side, ``[n, F]``; ``InputError`` naming a
    column that is not one number per input."""
    import numpy as np

    lengths = {len(columns[name]) if columns[name].ndim else -1 for name in order}
    for name in order:
        values = columns[name]
        if values.ndim != 1 or values.dtype.kind not in "iuf":
            what = f"{values.dtype.name} values" if values.ndim == 1 else f"shape {list(values.shape)}"
            raise InputError(f"column {name!r} must hold one number per input; it holds {what}")
    if len(lengths) > 1:
        raise InputError(f"the columns differ in length ({', '.join(f'{n!r}: {len(columns[n])}' for n in order[:6])})")
    return np.column_stack([columns[name] for name in order]) if order else np.empty((0, 0))


def table_columns(dataset: str) -> dict:
    """``Predictor.create``'s ``feature_names`` and ``label_column`` for a ``table:`` dataset with
    named columns (Parquet, CSV); nothing for other data (an ``.npz`` table's features have
    positions, not names)."""
    from dpsm_ray.own_data import parse_table, read_table

    if not dataset.startswith("table:"):
        return {}
    path, options = parse_table(dataset)
    if Path(path).suffix.lower() == ".npz":
        return {}
    return {"feature_names": read_table(dataset)[2], "label_column": options["label"]}


def _threshold(value) -> float:
    return math.inf if value is None else float(value)


def _json_thresholds(values: torch.Tensor) -> list:
    """Thresholds as predictor.json holds them: null for +inf (JSON has no infinity)."""
    return [value if math.isfinite(value) else None for value in values.tolist()]


def _is_threshold(value) -> bool:
    """A threshold as predictor.json holds it: a finite number, or null for +inf."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def _ascending_numbers(values) -> bool:
    return (isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
            and all(a <= b for a, b in zip(values, values[1:])))


def _as_number_tensor(x, what: str) -> torch.Tensor:
    """``x`` (a torch tensor, numpy array or nested list) as a CPU tensor of a real dtype."""
    if isinstance(x, torch.Tensor):
        tensor = x.detach().cpu()
    else:
        import numpy as np

        array = np.asarray(x) if not isinstance(x, np.ndarray) else x
        if array.dtype.kind not in "iuf":
            raise InputError(
                f"{what} must be numbers (integers or floats); got"
                f" {array.dtype.name if array.dtype.kind != 'O' else 'a ragged or mixed array'}"
            )
        array = np.ascontiguousarray(array)
        # torch shares the array's memory: a read-only one (a memory-mapped .npy) is copied first
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise InputError(f"{what} must be numbers (integers or floats); got {str(tensor.dtype).removeprefix('torch.')}")
    return tensor


def check_labels(y, num_classes: int) -> torch.Tensor:
    labels = _as_number_tensor(y, "labels")
    if labels.ndim != 1:
        raise InputError(f"labels must be one integer per input, shape [n]; got {list(labels.shape)}")
    if labels.is_floating_point():
        if not torch.equal(labels, labels.round()):
            raise InputError("labels must be integers (class indices)")
    labels = labels.to(torch.int64)
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise InputError(f"labels must lie in 0..{num_classes - 1}; found {int(labels.min())}..{int(labels.max())}")
    return labels


def check_ids(example_ids, n: int) -> torch.Tensor:
    if example_ids is None:
        return torch.arange(n)
    ids = _as_number_tensor(example_ids, "example ids")
    if ids.is_floating_point() or ids.shape != (n,):
        raise InputError(f"example ids must be {n} integers, one per input; got {'floats' if ids.is_floating_point() else list(ids.shape)}")
    return ids.to(torch.int64)


def _mask_lists(mask: torch.Tensor) -> list[list[int]]:
    """The classes in each row of a boolean ``[n, K]`` mask, ascending."""
    columns = mask.nonzero()[:, 1].tolist()
    lists, start = [], 0
    for size in mask.sum(dim=1).tolist():
        lists.append(columns[start : start + size])
        start += size
    return lists


def _known_model(spec: str) -> bool:
    try:
        model_card(spec)
    except ValueError:
        return False
    return True


def _check_info(info, where: str) -> None:
    """Raise ``PredictorError`` naming ``where`` and the field unless ``info`` is a predictor.json
    payload this version reads."""
    def need(ok: bool, field: str, allowed: str) -> None:
        if not ok:
            raise PredictorError(f"{where}: field {field} {allowed}")

    need(isinstance(info, dict), "(top level)", "must be an object")
    need(info.get("format") == FORMAT, "format", f"must be {FORMAT!r}; got {info.get('format')!r} (not a dpsm_ray predictor)")
    version = info.get("format_version")
    need(
        isinstance(version, int) and not isinstance(version, bool) and version >= 1,
        "format_version",
        f"must be an integer >= 1; got {version!r}",
    )
    if version > FORMAT_VERSION:
        raise PredictorError(f"{where}: format_version {version} is newer than this dpsm_ray {__version__} reads (up to {FORMAT_VERSION}); "
                             f"upgrade dpsm_ray (the predictor was written by dpsm_ray {info.get('package_version')})")
    missing = [field for field in _INFO_FIELDS if field not in info]
    need(not missing, missing[0] if missing else "", "is missing")
    model = info["model"]
    need(
        isinstance(model, dict) and isinstance(model.get("architecture"), str) and _known_model(model["architecture"]),
        "model.architecture",
        f"must be one of {model_choices()} (a model card of your own: register_model it before loading); got"
        f" {model.get('architecture') if isinstance(model, dict) else None!r}",
    )
    need(isinstance(model.get("num_classes"), int) and model["num_classes"] >= 2, "model.num_classes", "must be an integer >= 2")
    need(model.get("precision") in PRECISIONS, "model.precision", f"must be one of {', '.join(PRECISIONS)}")
    try:
        InputSpec.from_json(info["input"])
    except ValueError as error:
        raise PredictorError(f"{where}: {error}") from None
    features = info.get("feature_names")
    need(features is None or (isinstance(features, list) and len(features) == InputSpec.from_json(info["input"]).features
                               and all(isinstance(n, str) for n in features) and len(set(features)) == len(features)),
         "feature_names", "must be null or one distinct string per input feature")
    need(info.get("label_column") is None or isinstance(info["label_column"], str), "label_column", "must be null or a string")
    preparation = info.get("input_preparation")
    need(preparation is None or (isinstance(preparation, dict) and preparation.get("how") in _PREPARATIONS
                                 and isinstance(preparation.get("card"), dict)),
         "input_preparation", f"must be null or {{\"how\": {' or '.join(map(repr, _PREPARATIONS))}, \"card\": {{...}}}}")
    names = info["class_names"]
    need(names is None or (isinstance(names, list) and len(names) == model["num_classes"] and all(isinstance(n, str) for n in names)),
         "class_names", f"must be null or {model['num_classes']} strings")
    alpha = info["alpha"]
    need(isinstance(alpha, float) and 0 < alpha < 1, "alpha", "must be a number in the open interval (0, 1)")
    need(isinstance(info["uniform_seed"], int), "uniform_seed", "must be an integer")
    scores = info["scores"]
    need(isinstance(scores, dict) and set(scores) <= set(score_names()), "scores",
         f"must be an object keyed by {', '.join(score_names())} (a score of your own: register_score its card before loading)")
    calibration = info["calibration"]
    need(calibration is None or (isinstance(calibration, dict) and calibration.get("by", "marginal") in SET_RULES), "calibration.by",
         f"must be one of {', '.join(SET_RULES)}")
    risk = info.get("risk")
    need((risk is None and (calibration or {}).get("by") != "risk")
         or (isinstance(risk, dict) and isinstance(risk.get("costs"), list) and len(risk["costs"]) == model["num_classes"]
             and all(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c <= 1 for c in risk["costs"])
             and isinstance(risk.get("level"), float) and 0 < risk["level"] < 1),
         "risk", f"must be null or {{\"costs\": {model['num_classes']} numbers in [0, 1], \"level\": a number in (0, 1)}}"
         f"{' (calibration.by is risk)' if (calibration or {}).get('by') == 'risk' else ''}")
    by = calibration.get("by", "marginal") if isinstance(calibration, dict) else "marginal"
    for kind, entry in scores.items():
        _check_score(need, kind, entry, model["num_classes"], by, risk)
    weights = info["weights"]
    need(
        isinstance(weights, dict)
        and isinstance(weights.get("file"), str)
        and Path(weights["file"]).name == weights["file"]
        and weights["file"] not in ("", ".", ".."),
        "weights.file",
        "must be a file name inside the predictor directory",
    )


def _check_score(need, kind: str, entry, classes: int, by: str, risk) -> None:
    """One score's entry of predictor.json: its thresholds (marginal, and those of the calibration
    ``by``), its calibration points and kept scores, and its card's parameters."""
    by_class = by == "class"
    threshold = entry.get("threshold", "missing") if isinstance(entry, dict) else "missing"
    need(_is_threshold(threshold), f"scores.{kind}.threshold", "must be a finite number, or null for an infinite threshold")
    need(isinstance(entry.get("calibration_points"), int), f"scores.{kind}.calibration_points", "must be an integer")
    per_class = entry.get("class_thresholds")
    need((per_class is None and not by_class) or (isinstance(per_class, list) and len(per_class) == classes
                                                   and all(map(_is_threshold, per_class))),
         f"scores.{kind}.class_thresholds",
         f"must be {classes} finite numbers or nulls (infinite){' (calibration.by is class)' * by_class}")
    for how, kept_as in (("cluster", "clusters"), ("rc3p", "rc3p_rank_limits")):
        values, other = entry.get(f"{how}_thresholds"), entry.get(kept_as)
        least = -1 if how == "cluster" else 1
        need((values is None and other is None and by != how)
             or (isinstance(values, list) and len(values) == classes and all(map(_is_threshold, values))
                 and isinstance(other, list) and len(other) == classes
                 and all(isinstance(v, int) and not isinstance(v, bool) and least <= v <= max(classes, 0) for v in other)),
             f"scores.{kind}.{how}_thresholds",
             f"must be {classes} finite numbers or nulls, with {kept_as}: {classes} integers"
             f"{' (calibration.by is ' + how + ')' if by == how else ''}")
    need(_is_threshold(entry.get("risk_threshold")) and (risk is None) == ("risk_threshold" not in entry),
         f"scores.{kind}.risk_threshold", "must be a finite number or null (infinite), there exactly when risk is")
    kept = entry.get("calibration_scores")
    need(kept is None or (isinstance(kept, list) and len(kept) == classes and all(_ascending_numbers(part) for part in kept)
                          and sum(map(len, kept)) == entry["calibration_points"]),
         f"scores.{kind}.calibration_scores",
         f"must be {classes} ascending lists of finite numbers, {entry['calibration_points']} in all")
    for name, default in score_card(kind).parameters.items():
        value = entry.get(name)
        integral = isinstance(default, int)
        need(
            isinstance(value, int if integral else (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0,
            f"scores.{kind}.{name}",
            f"must be {'an integer' if integral else 'a number'} >= 0",
        )
