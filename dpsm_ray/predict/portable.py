"""Predictors that run without dpsm_ray: ``dpsm-ray export --format torchscript|onnx``.

    dpsm-ray export predictors/dpsm --format onnx --out portable/dpsm
    dpsm-ray export results/digits --method dpsm --format torchscript --score aps --calibration class --out portable/dpsm-aps

The directory written holds one score's sets under one calibration:

    model.pt | model.onnx   raw inputs x [n, *shape] float32 (and, for a randomised score, u [n] float64: one
                            uniform per input) -> scores [n, K] float64, S(x, y), and ranks [n, K] int64
    thresholds.json         the score, the calibration, alpha, the classes, a threshold and a rank limit per class
    LOAD.md                 the loader: torch alone (TorchScript), or onnxruntime and numpy (ONNX)

The set of an input is {y : S(x, y) <= thresholds[y] and rank(x, y) <= rank_limits[y]}, rank 1 the most probable
class.  The module is ``Predictor.predict_sets``'s own computation, traced: the input preparation
(``InputSpec.apply``), the network, the softmax in float64 and the score card's matrix -- so raw inputs go in, and
TorchScript, running torch's kernels, gives the predictor's sets bit for bit on the CPU.  ONNX Runtime runs its own
float32 kernels: the logits differ from torch's in their last bits, the scores by up to about 1e-6 (1.3e-6 on the
digits MLP of the tests), which changes a set only for a score that close to a threshold.

Every set rule of a predictor reads as a threshold and a rank limit per class (``Predictor.set_thresholds``, the one
place that says so): marginal, q for every class; class-conditional, q_y; clustered, its cluster's q; risk-controlled,
lambda for every class; RC3P, q_y and a limit k_y on the rank of y -- K, no limit, for the others.

Torch and the exporters are imported when a file is written, so ``dpsm-ray --help`` reads the formats without torch.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import json
import os
import shutil
import textwrap
import warnings
from pathlib import Path

from dpsm_ray import __version__
from dpsm_ray.conformal import CALIBRATION_TITLES
from dpsm_ray.files import fsync_directory, temporary_path

FORMAT = "dpsm_ray portable predictor"
FORMAT_VERSION = 1
MODEL_FILES = {"torchscript": "model.pt", "onnx": "model.onnx"}  # each format's model file
THRESHOLDS_FILE = "thresholds.json"
LOAD_FILE = "LOAD.md"
_DEFAULT_SCORE = "hps"  # Predictor.predict_sets's
# ONNX opset 17 (2022): onnxruntime runs it from 1.12 on; torch's TorchScript-based exporter writes opsets up to 20
_ONNX_OPSET = 17


# ----------------------------------------------------------------------------- the thresholds and the module


def set_thresholds(predictor, score: str, calibration: str | None = None) -> tuple[list[float], list[int]]:
    """thresholds.json's ``thresholds`` and ``rank_limits``: the threshold of each class, ``[K]`` (``inf``:
    the threshold admits the class in every set), and the limit on its rank, ``[K]`` (``K``: none), whose sets
    {y : S(x, y) <= thresholds[y] and rank(x, y) <= rank_limits[y]} are ``predictor``'s sets of ``score``
    under ``calibration`` (None: its own).  ``Predictor.set_thresholds`` is the one place a calibration says
    what its sets hold y by; of those there, only RC3P limits ranks."""
    thresholds, rank_limits = predictor.set_thresholds(score, calibration)
    classes = predictor.num_classes
    return thresholds.tolist(), rank_limits.tolist() if rank_limits is not None else [classes] * classes


def set_scores(predictor, score: str):
    """``predictor``'s computation from raw inputs to ``score``'s matrix, as a module on the CPU (a copy of
    its network): ``forward(x)``, or ``forward(x, u)`` for a randomised score, gives ``(scores, ranks)``,
    each ``[n, K]``, as ``Predictor.sets_from_proba`` computes them from ``predict_proba``."""
    import torch

    from dpsm_ray.cards import score_matrix
    from dpsm_ray.conformal import label_ranks

    spec, parameters = predictor.input_spec, predictor.score_parameters(score)

    class SetScores(torch.nn.Module):  # defined here, as torch is imported only when a file is written
        def __init__(self) -> None:
            super().__init__()
            self.network = copy.deepcopy(predictor.model).cpu().eval()

        def forward(self, x, u=None):
            # Predictor.logits, then ordered_proba: the input preparation, float32 logits, the softmax in float64;
            # then the ranks RC3P's rank limits read (Predictor.sets_from_proba)
            probs = self.network(spec.apply(x)).float().double().softmax(dim=1)
            return score_matrix(probs, score, u=u, parameters=parameters), label_ranks(probs)

    return SetScores()


def write_torchscript(module, example: tuple, path: Path) -> None:
    import torch

    with warnings.catch_warnings(), torch.no_grad():
        # torch 2.14 marks torch.jit deprecated for torch.export; a TorchScript file is still what torch.jit.load (and
        # libtorch, in C++) runs with torch alone, and the notice is for this package, not for whoever exports
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.trace(module, example), str(path))


def _write_onnx(module, example: tuple, path: Path) -> None:
    import torch

    names = ["x", "u"][: len(example)]
    # the TorchScript-based exporter (dynamo=False): it needs the onnx package alone, where torch's default since 2.9,
    # the torch.export-based one, also needs onnxscript and its onnx_ir; deprecated, but it writes this graph --
    # the stable sorts included (topk_sorts) -- to the last rank (tests/test_portable_export.py)
    legacy = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    with warnings.catch_warnings(), topk_sorts(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, example, str(path), input_names=names, output_names=["scores", "ranks"], opset_version=_ONNX_OPSET,
                          dynamic_axes={name: {0: "n"} for name in (*names, "scores", "ranks")}, **legacy)


@contextlib.contextmanager
def topk_sorts():
    """While it lasts, the TorchScript-based ONNX exporter writes ``sort`` and ``argsort`` as ONNX's TopK over
    the whole axis.  It refuses ``sort(stable=True)`` -- it reads ``stable`` as an ``out=`` argument -- and TopK
    is that sort: equal values keep the order of their indices (the ONNX operator's specification)."""
    import torch
    from torch.onnx import symbolic_helper

    def sort(g, values, *arguments):  # (dim, descending) or (stable, dim, descending)
        dim, descending = (symbolic_helper._get_const(value, "i", name) for value, name in zip(arguments[-2:], ("dim", "descending")))
        size = g.op("Gather", g.op("Shape", values), g.op("Constant", value_t=torch.tensor([dim], dtype=torch.int64)))
        return g.op("TopK", values, size, axis_i=dim, largest_i=descending, sorted_i=1, outputs=2)

    def argsort(g, values, *arguments):
        return sort(g, values, *arguments)[1]

    for name, symbolic in (("aten::sort", sort), ("aten::argsort", argsort)):
        torch.onnx.register_custom_op_symbolic(name, symbolic, _ONNX_OPSET)
    try:
        yield
    finally:
        for name in ("aten::sort", "aten::argsort"):
            torch.onnx.unregister_custom_op_symbolic(name, _ONNX_OPSET)


# ----------------------------------------------------------------------------- the loaders (LOAD.md, docs/predictor.md)

_UNIFORMS_NUMPY = '''
def uniforms(seed, ids):
    """dpsm_ray's uniform of each input id (dpsm_ray.seeding.counter_uniforms): U(0, 1), a pure function of (seed, id)."""
    mask = np.uint64(0xFFFFFFFF)

    def mix(x):
        for _ in range(2):
            x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x45D9F3B)) & mask
        return x ^ (x >> np.uint64(16))

    x = (np.asarray(ids, dtype=np.int64) & 0xFFFFFFFF).astype(np.uint64) ^ np.uint64((seed * 0x9E3779B9) & 0xFFFFFFFF)
    x = mix(mix(x) ^ np.uint64((seed >> 32) & 0xFFFFFFFF))
    return (x.astype(np.float64) + 0.5) / 2.0**32
'''

_UNIFORMS_TORCH = '''
def uniforms(seed, ids):
    """dpsm_ray's uniform of each input id (dpsm_ray.seeding.counter_uniforms): U(0, 1), a pure function of (seed, id)."""
    mask = 0xFFFFFFFF

    def mix(x):
        for _ in range(2):
            x = ((x ^ (x >> 16)) * 0x45D9F3B) & mask
        return x ^ (x >> 16)

    x = (torch.as_tensor(ids, dtype=torch.int64) & mask) ^ ((seed * 0x9E3779B9) & mask)
    x = mix(mix(x) ^ ((seed >> 32) & mask))
    return (x.to(torch.float64) + 0.5) / 2.0**32
'''

# each format's loader: prediction_sets(directory, x, ids) is the boolean mask [n, K] of Predictor.predict_sets
LOADERS = {
    "torchscript": '''import json

import torch

''' + _UNIFORMS_TORCH + '''

def prediction_sets(directory, x, ids=None):
    """Whether class y is in input i's set, [n, K] bool; x: raw inputs [n, *shape]; ids: each input's id
    (default 0 .. n-1), which draws its uniform for a randomised score."""
    with open(f"{directory}/thresholds.json") as file:
        rule = json.load(file)
    model = torch.jit.load(f"{directory}/{rule['model']}")
    x = torch.as_tensor(x, dtype=torch.float32)
    u = () if rule["uniforms"] is None else (uniforms(rule["uniforms"]["seed"], torch.arange(len(x)) if ids is None else ids),)
    with torch.no_grad():
        scores, ranks = model(x, *u)
    thresholds = torch.tensor([float("inf") if q is None else q for q in rule["thresholds"]], dtype=torch.float64)
    return (scores <= thresholds) & (ranks <= torch.tensor(rule["rank_limits"]))
''',
    "onnx": '''import json

import numpy as np
import onnxruntime

''' + _UNIFORMS_NUMPY + '''

def prediction_sets(directory, x, ids=None):
    """Whether class y is in input i's set, [n, K] bool; x: raw inputs [n, *shape]; ids: each input's id
    (default 0 .. n-1), which draws its uniform for a randomised score."""
    with open(f"{directory}/thresholds.json") as file:
        rule = json.load(file)
    session = onnxruntime.InferenceSession(f"{directory}/{rule['model']}", providers=["CPUExecutionProvider"])
    feeds = {"x": np.asarray(x, dtype=np.float32)}
    if rule["uniforms"] is not None:
        feeds["u"] = uniforms(rule["uniforms"]["seed"], np.arange(len(feeds["x"])) if ids is None else ids)
    scores, ranks = session.run(["scores", "ranks"], feeds)
    thresholds = np.array([np.inf if q is None else q for q in rule["thresholds"]])
    return (scores <= thresholds) & (ranks <= np.array(rule["rank_limits"]))
''',
}


def _load_text(rule: dict, form: str) -> str:
    """LOAD.md of an export: what the files are, what the sets are, and the loader."""
    shape = ", ".join(map(str, rule["input"]["shape"]))
    title = CALIBRATION_TITLES.get(rule["calibration"], rule["calibration"])
    score, needs = rule["score"], "torch" if form == "torchscript" else "onnxruntime and numpy"
    uniform = "" if rule["uniforms"] is None else ", and `u`, one uniform per input, [n] float64"
    features = f" Its features, in order: {', '.join(rule['feature_names'])}." if rule.get("feature_names") else ""
    if rule["uniforms"] is None:
        randomness = f"{score} is not randomised: an input's set depends on the input alone."
    else:
        randomness = (f"{score} is randomised: an input's set depends on its uniform u. dpsm_ray's own are `uniforms("
                      f"{rule['uniforms']['seed']}, ids)` below, from each input's id (by default its position); any independent "
                      "U(0, 1) draws keep the guarantee.")
    paragraphs = [
        f"Written by `dpsm-ray export --format {form}` (dpsm_ray {__version__}); it runs with {needs} alone.",
        f"- `{rule['model']}` takes `x`, raw inputs [n, {shape}] float32 ({rule['input']['raw']}; it prepares them "
        f"itself){uniform}. It gives `scores`, S(x, y) of every class, [n, K] float64, and `ranks`, each class's rank among "
        f"the model's probabilities, [n, K] int64 (1: the most probable; ties to the lower class index).{features}",
        f"- `{THRESHOLDS_FILE}`: `thresholds` (null: infinite) and `rank_limits`, one per class; the class names.",
        "The set of an input is {y : scores[y] <= thresholds[y] and ranks[y] <= rank_limits[y]}: dpsm_ray's "
        f"`Predictor.predict_sets(x, score=\"{score}\", calibration=\"{rule['calibration']}\")`, with the guarantee "
        f"dpsm_ray's docs/predictor.md gives {title} sets on inputs drawn like the calibration data. {randomness}",
    ]
    text = "\n\n".join(textwrap.fill(part, 110, subsequent_indent="  " if part.startswith("- ") else "") for part in paragraphs)
    usage = f"sets = prediction_sets(\"path/to/this/directory\", x)  # x: [n, {shape}], numpy or torch"
    heading = f"# {score} conformal prediction sets, {title} calibration, alpha {rule['alpha']:g}"
    return f"{heading}\n\n{text}\n\n```python\n{LOADERS[form]}```\n\n    {usage}\n"


# ----------------------------------------------------------------------------- writing


def _check_out(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """``out`` as a Path once it may be written: new, empty, or with ``overwrite`` an earlier export
    (it holds thresholds.json); ``PredictorError`` naming it otherwise."""
    from dpsm_ray.predict.predictor import PredictorError

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PredictorError(f"--out {out} is a file; choose a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / THRESHOLDS_FILE).is_file():
            raise PredictorError(f"--out {out} is a non-empty directory without an export in it; choose a new or empty directory")
        if not overwrite:
            raise PredictorError(f"--out {out} holds an export already; choose another directory, or --overwrite it")
    return out


def export_portable(predictor, out: str | os.PathLike, form: str, *, score: str | None = None, calibration: str | None = None,
                    overwrite: bool = False, source: dict | None = None) -> Path:
    """Write ``predictor``'s sets of ``score`` (default hps) under ``calibration`` (None: its own) into the
    directory ``out`` as ``form`` (``torchscript`` or ``onnx``): the model file, thresholds.json and LOAD.md
    (module docstring).  The files are written into a temporary directory beside ``out``, renamed into place
    when whole; an export already in ``out`` is replaced only with ``overwrite``.  ``source``: where the
    predictor came from (its directory, why it was chosen), recorded in thresholds.json.  ``PredictorError``, in
    one line, for an unknown format, a missing onnx package, a bf16 model, an uncalibrated score or calibration,
    and a model or score whose trace would hold a value of the example inputs (``torch.jit.TracerWarning``)."""
    import torch

    from dpsm_ray.cards import score_card
    from dpsm_ray.predict.predictor import PredictorError

    if form not in MODEL_FILES:
        raise PredictorError(f"format must be one of {', '.join(MODEL_FILES)}; got {form!r}")
    if form == "onnx" and importlib.util.find_spec("onnx") is None:
        raise PredictorError('--format onnx needs the onnx package, which torch\'s exporter writes with: pip install "dpsm_ray[onnx]"')
    out = _check_out(out, overwrite)
    precision = predictor.info["model"]["precision"]
    if precision != "fp32":
        raise PredictorError(f"this predictor's model runs in {precision} (model.precision): only an fp32 model exports, so that the "
                             "exported sets are the predictor's")
    score = _DEFAULT_SCORE if score is None else score
    how = predictor.calibration_of(calibration)
    thresholds, rank_limits = set_thresholds(predictor, score, how)
    randomised = score_card(score).randomised
    spec = predictor.input_spec
    uniforms = {"seed": predictor.uniform_seed, "drawn": "dpsm_ray.seeding.counter_uniforms(seed, input id): LOAD.md's uniforms"}
    rule = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model": MODEL_FILES[form],
        "score": score, "score_parameters": predictor.score_parameters(score), "calibration": how, "alpha": predictor.alpha,
        "class_names": predictor.class_names,
        "input": {"shape": list(spec.shape), "dtype": "float32", "raw": spec.raw},
        **({"feature_names": list(predictor.feature_names)} if predictor.feature_names else {}),
        "thresholds": [None if q == float("inf") else q for q in thresholds], "rank_limits": rank_limits,
        "uniforms": uniforms if randomised else None,
        "source": {"run_id": predictor.info["run_id"], "method": predictor.info["method"], "package_version": __version__,
                   **(source or {})},
    }
    example = (torch.zeros(2, *spec.shape),) + ((torch.full((2,), 0.5, dtype=torch.float64),) if randomised else ())

    def write(directory: Path) -> None:
        writer = write_torchscript if form == "torchscript" else _write_onnx
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            writer(set_scores(predictor, score), example, directory / MODEL_FILES[form])
        fixed = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
        for other in (w for w in caught if w not in fixed):
            warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
        if fixed:  # Python control flow on a tensor's value, say: the file would hold the example's branch for every input
            raise PredictorError(f"the model or the {score} score does not trace to one graph for every input, so it does not export "
                                 f"({str(fixed[0].message).splitlines()[0][:160]})")
        (directory / THRESHOLDS_FILE).write_text(_readable_json(rule), encoding="utf-8")
        (directory / LOAD_FILE).write_text(_load_text(rule, form), encoding="utf-8")

    _write_directory(out, write)
    return out


def _readable_json(payload: dict) -> str:
    """``payload`` with one top-level field a line (a list of K thresholds stays one line)."""
    return "{\n" + ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in payload.items()) + "\n}\n"


def _write_directory(out: Path, write) -> None:
    """``write(directory)`` into a temporary directory beside ``out``, its files synced, then renamed to
    ``out`` (an earlier export there moved aside, and removed once the new one is in place): ``out`` is the
    new export or the old one, never a mix."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = temporary_path(out)
    aside = partial.with_name(partial.name + ".old")
    shutil.rmtree(partial, ignore_errors=True)  # left by a writer of this process id that was killed
    partial.mkdir()
    try:
        write(partial)
        for path in partial.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        if out.is_dir() and any(out.iterdir()):
            os.rename(out, aside)
        try:
            os.replace(partial, out)  # onto a new or an empty directory
        except BaseException:
            if aside.exists():
                os.rename(aside, out)
            raise
        fsync_directory(out.parent)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)


def export_source(source: str | os.PathLike, out: str | os.PathLike, form: str, *, method: str | None = None, seed: int | None = None,
                  score: str | None = None, calibration: str | None = None, overwrite: bool = False, trust_code: bool = False,
                  log=print) -> Path:
    """``dpsm-ray export SOURCE --format torchscript|onnx``: ``export_portable`` of the predictor in the directory
    ``source`` or, with ``method``, of the sweep in ``source``'s chosen predictor of that method (``seed``'s:
    ``export.chosen_predictor``).  ``--out`` is checked before anything is read or built."""
    from dpsm_ray.predict.export import chance_line, chosen_predictor
    from dpsm_ray.predict.predictor import Predictor

    _check_out(out, overwrite)
    source, chosen = Path(source), {}
    if method is not None:
        source, why = chosen_predictor(source, method, seed, log=log)
        chosen = {"chosen_by": why}
    predictor = Predictor.load(source, device="cpu", trust_code=trust_code)
    out = export_portable(predictor, out, form, score=score, calibration=calibration, overwrite=overwrite,
                          source={"predictor": str(source.resolve()), **chosen})
    log(f"{source} -> {out}: {score or _DEFAULT_SCORE} sets, {predictor.calibration_of(calibration)} calibration, alpha "
        f"{predictor.alpha:g} ({MODEL_FILES[form]} and {THRESHOLDS_FILE}; {LOAD_FILE} shows how to load them)")
    warning = chance_line(predictor)
    if warning is not None:
        log(warning)
    return out
