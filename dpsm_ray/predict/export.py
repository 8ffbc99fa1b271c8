"""Finished runs as predictors (``dpsm_ray.predict.predictor``): a sweep's final models, a ``dpsm-ray
train --out`` run, and ``dpsm-ray export``.

A run's predictor is calibrated on the run's whole calibration split and measured on its test
split, with the inputs, forward passes and uniforms of the run's own evaluation
(``train.loop.final_evaluation``): only the partition differs -- evals.parquet's rows re-split the
pooled calibration and test points at random, the predictor keeps the original split
(docs/predictor.md).

    RESULTS/predictors/<method>-seed<seed>/   one predictor per final model of a sweep
    RESULTS/predictors/index.json             every one of them, and the one chosen per method

Nothing here imports Ray.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from dpsm_ray.files import CorruptFileError, read_checked_json, sha256_file, write_checked_json
from dpsm_ray.predict.predictor import INFO_FILE, Predictor, PredictorError, pick_device, table_columns
from dpsm_ray.storage.layout import (
    CHECKPOINT_FILE,
    INDEX_FILE,
    CoverageFloor,
    PREDICTORS,
    Ledger,
    ResultsInUse,
    ResultsLock,
    read_index,
    read_sweep_settings,
)

CHOICE_RULE = ("the final model with the smallest validation set size among those whose validation coverage reaches the sweep's floor "
               "(1 - alpha - coverage slack, the search's feasibility), else the one with the highest validation coverage; ties go to the "
               "lower seed. Validation data only: test results never choose")


def predictor_for_run(config, model_state: dict, *, data=None, device: str = "auto", provenance: dict | None = None) -> Predictor:
    """The model of a finished run (``TrainConfig`` ``config``, weights ``model_state``) as a
    predictor calibrated on the run's calibration split and measured on its test split.
    ``data``: the run's ``DataSplits`` when already loaded (on the CPU)."""
    from dpsm_ray.cards import build_model
    from dpsm_ray.train.loop import load_data
    from dpsm_ray.train.step import resolve_precision

    device = pick_device(device)
    # precision auto: what it stands for on this device (the same on every device until a GPU run measures the fast path)
    precision = resolve_precision(config.precision, device)
    data = data if data is not None else load_data(config, torch.device("cpu"))
    if data.input_spec is None:
        raise ValueError(f"dataset {data.name} does not describe its inputs (DataSplits.input_spec): it cannot become a predictor")
    architecture = config.resolved_model()
    model = build_model(architecture, data.num_classes, input_shape=data.input_shape)
    model.load_state_dict(model_state)
    predictor = Predictor.create(
        model, architecture=architecture, input_spec=data.input_spec, num_classes=data.num_classes, alpha=config.alpha,
        class_names=data.class_names, **table_columns(config.dataset), uniform_seed=config.seed, precision=precision,
        method=config.method, seed=config.seed, run_id=config.config_hash(), training_config=config.to_dict(), provenance=provenance,
        device=device,
    )
    return _calibrated_on_splits(predictor, data, ("cal",), ("test",), config.dataset, f"split seed {config.data_seed()}")


def _calibrated_on_splits(predictor: Predictor, data, calibration: tuple[str, ...], test: tuple[str, ...], dataset: str,
                         seeded: str, warn=None) -> Predictor:
    """``predictor`` calibrated on the ``calibration`` splits of ``data`` and measured on its
    ``test`` splits (none: no test metrics), with the inputs, forward passes and uniforms of a
    run's own evaluation (``train.loop.final_evaluation``) when it prepares inputs as the dataset's
    card does; else through its own preparation of the raw inputs.  ``warn(line)`` is told when a
    model trained elsewhere looks prepared the other way (``Predictor.preparation_warning``)."""
    from dpsm_ray.train.env import LocalEnv
    from dpsm_ray.train.loop import predict

    env = LocalEnv(predictor.device, log=lambda line: None)
    precision = predictor.info["model"]["precision"]
    as_card = predictor.input_preparation == "card"

    def probabilities(names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # as final_evaluation computes them
        splits = [getattr(data, name) for name in names]
        if as_card:
            probs = [predict(predictor.model, s, torch.arange(len(s)), data.num_classes, env, precision).double().softmax(dim=1).cpu()
                     for s in splits]
        else:
            probs = [predictor.ordered_proba(s.inputs) for s in splits]
        return torch.cat(probs), torch.cat([s.labels.cpu() for s in splits]), torch.cat([s.ids.cpu() for s in splits])

    def described(names: tuple[str, ...], points: int) -> str:
        which = "every split" if len(names) == 4 else " and ".join(f"the {'calibration' if n == 'cal' else n} split" for n in names)
        return f"{which} of {dataset} ({points} points, {seeded})"

    probs, labels, ids = probabilities(calibration)
    if warn is not None and "input_preparation" in predictor.info:
        line = predictor.preparation_warning(torch.cat([getattr(data, name).inputs for name in calibration]), labels, probs,
                                             flag="--prepare ")
        if line is not None:
            warn(line)
    calibrated = predictor.calibrated(probs, labels, predictor.alpha, example_ids=ids, data=described(calibration, len(labels)))
    if not test:
        return calibrated
    probs, labels, ids = probabilities(test)
    measured = calibrated.measure(probs, labels, example_ids=ids)
    accuracy = float((probs.argmax(dim=1) == labels).double().mean()) if len(labels) else None
    return calibrated.with_test(measured, len(labels), described(test, len(labels)), accuracy=accuracy)


def calibrate_weights(weights: str | os.PathLike, architecture: str, dataset: str, *, split: str = "cal", alpha: float = 0.1,
                      seed: int = 0, data_root: str | None = None, precision: str = "fp32", device: str = "auto",
                      prepare: str = "none", warn=None) -> Predictor:
    """``dpsm-ray calibrate``: the weights in ``weights`` (a state dict, ``.pt`` read with
    ``weights_only`` or ``.safetensors``) of ``architecture``, its inputs prepared ``prepare``
    (``Predictor.from_model``), calibrated on ``split`` of ``dataset`` (its splits drawn by
    ``seed``; ``all``: every example) and measured on its test split unless that one calibrated.
    ``warn(line)``: told when the other preparation looks like the one the model trained on."""
    from dpsm_ray.cards import build_model, load_splits
    from dpsm_ray.files import sha256_file
    from dpsm_ray.models.weights import load_weights

    data = load_splits(dataset, data_root, seed=seed)
    model = build_model(architecture, data.num_classes, input_shape=data.input_shape)
    load_weights(model, weights, architecture, option="--weights ")
    from dpsm_ray.cards import data_record

    provenance = {"source": "dpsm-ray calibrate", "weights": str(Path(weights).resolve()), "weights_sha256": sha256_file(weights),
                  "data": data_record(dataset)}
    predictor = Predictor.from_model(model, architecture=architecture, dataset=dataset, alpha=alpha, seed=seed, data_root=data_root,
                                     precision=precision, provenance=provenance, device=device, data=data, prepare=prepare)
    calibration = ("train", "val", "cal", "test") if split == "all" else (split,)
    test = () if split in ("all", "test") else ("test",)
    return _calibrated_on_splits(predictor, data, calibration, test, dataset, f"split seed {seed}", warn=warn)


def chance_line(predictor: Predictor) -> str | None:
    """A warning when a predictor's model is at or near chance (``dpsm_ray.results.tables.chance_warning``):
    on its test split (``test``'s accuracy and its sets' sizes), else -- a predictor without test
    figures (``calibrate --split all``) -- on its calibration points' accuracy; else None.  Its sets
    still cover, by holding (nearly) every class."""
    from dpsm_ray.results.tables import chance_warning

    test = predictor.info["test"]
    if test and test["scores"]:
        accuracy = test.get("accuracy")
        why = chance_warning(accuracy if accuracy is not None else 1.0, predictor.num_classes,
                             min(entry["set_size"] for entry in test["scores"].values()))
    else:
        accuracy = (predictor.info["calibration"] or {}).get("accuracy")
        why = None if accuracy is None else chance_warning(accuracy, predictor.num_classes, measured="accuracy on the calibration points")
    if why is None:
        return None
    return (f"warning: this model is at or near chance ({why}): its sets cover by holding (nearly) every class and say little about "
            "the label; train longer, or check that it takes its inputs as the predictor prepares them")


def _existing_info(directory: Path) -> dict | None:
    """The info of a whole, unchanged predictor in ``directory`` (its weights match their
    sha256), or None."""
    try:
        info = read_checked_json(directory / INFO_FILE)
        weights = directory / info["weights"]["file"]
        return info if weights.is_file() and sha256_file(weights) == info["weights"]["sha256"] else None
    except (OSError, CorruptFileError, KeyError, TypeError):
        return None


def _final_predictors(results: Path) -> dict[int, tuple[dict, object, dict | None]]:
    """Each finished final trial of the sweep in ``results`` (by its index in the ledger): its
    record, its ``TrainConfig``, and its predictor's info (``_current_info``; None: a predictor
    to write)."""
    from dpsm_ray.config import TrainConfig

    finals = {}
    for index, record in sorted(Ledger(results).records("final").items()):
        if record["status"] == "ok":
            config = TrainConfig.from_dict(record["config"])
            finals[index] = record, config, _current_info(results, config)
    return finals


def _current_info(results: Path, config) -> dict | None:
    """The info of ``config``'s predictor under ``results/predictors/`` when it is whole and
    built from this run (``config``'s hash), else None."""
    info = _existing_info(results / PREDICTORS / _predictor_name(config))
    return info if info is not None and info["run_id"] == config.config_hash() else None


def _predictor_name(config) -> str:
    return f"{config.method}-seed{config.seed}"


def export_final_model(results: str | os.PathLike, index: int, record: dict, sweep: str, *, data=None, device: str = "auto") -> str:
    """Write final trial ``index`` (its ledger ``record``) of the sweep named ``sweep`` in
    ``results`` as a predictor under ``results/predictors/`` (replacing one built from another
    run); its name.  ``data``: the run's ``DataSplits`` when already loaded.  Run in the driver
    (``export_sweep``) or as one Ray task per model (the sweep's ``export_predictors``): it reads
    and writes only files."""
    from dpsm_ray.config import TrainConfig
    from dpsm_ray.train.env import load_checkpoint

    results = Path(results)
    run_dir = Ledger(results).run_dir("final", index)
    config = TrainConfig.from_dict(record["config"])
    provenance = {
        "source": f"sweep {sweep}, final stage", "trial_index": index, "trial_id": record["trial_id"],
        "run_dir": str(run_dir.relative_to(results)), "validation": record["metrics"],
        "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"), "data": read_sweep_settings(results).get("data"),
    }
    state = load_checkpoint(run_dir / CHECKPOINT_FILE)["model"]
    predictor = predictor_for_run(config, state, data=data, device=device, provenance=provenance)
    name = _predictor_name(config)
    predictor.save(results / PREDICTORS / name, overwrite=True)  # the run changed: its predictor is rebuilt
    return name


class ExportProgress:
    """Lines for a long export: the first model's, then at most one each ``every`` seconds, and
    the last, each with how many are done and the time left."""

    def __init__(self, total: int, log, every: float = 15.0) -> None:
        self.total, self.log, self.every = total, log, every
        self.done, self.started, self.said = 0, time.monotonic(), None

    def ended(self, name: str, where: str = "") -> None:
        from dpsm_ray.timing import duration_text

        self.done += 1
        now = time.monotonic()
        if self.said is not None and now - self.said < self.every and self.done < self.total:
            return
        self.said = now
        left = ""
        if self.done < self.total:
            left = f", about {duration_text((now - self.started) / self.done * (self.total - self.done))} left"
        self.log(f"predictors: {name} written{where}, {self.done} of {self.total}{left}")


def _export_in_driver(results: Path, sweep: str, stale: dict[int, dict], log, device: str = "auto") -> None:
    """``stale``'s predictors (``{ledger index: record}``) built here, one after another, each
    data split loaded once."""
    from dpsm_ray.config import TrainConfig
    from dpsm_ray.train.loop import load_data

    loaded = {}  # the final models share their data split
    progress = ExportProgress(len(stale), log)
    for index, record in stale.items():
        config = TrainConfig.from_dict(record["config"])
        key = (config.dataset, config.data_root, config.data_seed(), config.train_subset)
        if key not in loaded:
            loaded[key] = load_data(config, torch.device("cpu"))
        progress.ended(export_final_model(results, index, record, sweep, data=loaded[key], device=device))


def export_sweep(results: str | os.PathLike, log=print, device: str = "auto", build=None) -> dict:
    """Write every finished final model of the sweep in ``results`` as a predictor under
    ``results/predictors/`` and the index naming each method's chosen one (``CHOICE_RULE``);
    returns the index.  A predictor already there for the same run is kept, so running this
    again (a resumed sweep) rewrites only the index.  ``build(results, sweep, stale, log)``
    writes the missing ones (``stale``: ``{ledger index: record}``, ``sweep``: the sweep's name);
    by default here, one after another."""
    results = Path(results)
    settings = read_sweep_settings(results)
    floor = CoverageFloor.of(settings)
    finals = _final_predictors(results)
    stale = {index: record for index, (record, _, info) in finals.items() if info is None}
    if stale:
        log(f"predictors: writing {len(stale)} final model{'s' * (len(stale) > 1)} as conformal predictors under {results / PREDICTORS}")
        (build or (lambda r, n, s, lg: _export_in_driver(r, n, s, lg, device)))(results, settings["name"], stale, log)
    entries, exported = [], []
    for index, (record, config, info) in finals.items():
        name = _predictor_name(config)
        if index in stale:  # written just now: read once more
            info = _current_info(results, config)
            if info is None:
                raise PredictorError(f"final trial {index} ({name}) has no predictor under {results / PREDICTORS} after exporting it")
            exported.append(name)
        metrics = record["metrics"]
        entries.append({
            "name": name,
            "directory": f"{PREDICTORS}/{name}",
            "method": config.method,
            "seed": config.seed,
            "run_id": info["run_id"],
            "val_set_size": metrics.get("val_set_size"),
            "val_coverage": metrics.get("val_coverage"),
            "test": info["test"],
        })
    index = {"rule": CHOICE_RULE, "coverage_floor": floor.value, "predictors": entries, "chosen": choose(entries, floor)}
    write_checked_json(results / PREDICTORS / INDEX_FILE, index)
    if exported:
        log(
            f"exported {len(exported)} final model{'s' * (len(exported) > 1)} as conformal predictors under {results / PREDICTORS}:"
            f" {', '.join(exported)}"
        )
    return index


def choose(entries: list[dict], floor: CoverageFloor) -> dict[str, str]:
    """``{method: predictor name}`` by ``CHOICE_RULE``."""
    chosen = {}
    for method in dict.fromkeys(entry["method"] for entry in entries):
        mine = [e for e in entries if e["method"] == method]
        reaching = [e for e in mine if floor.feasible(e["val_coverage"])]
        if reaching:
            best = min(reaching, key=lambda e: (e["val_set_size"], e["seed"]))
        else:
            best = min(mine, key=lambda e: (-(e["val_coverage"] or 0.0), e["seed"]))
        chosen[method] = best["name"]
    return chosen


def export_chosen(results: str | os.PathLike, method: str, out: str | os.PathLike, seed: int | None = None, log=print,
                  overwrite: bool = False) -> Path:
    """Copy the predictor of ``method`` (its chosen final model, or seed ``seed``'s) out of
    the sweep in ``results`` into ``out``, verified and with its provenance; builds the sweep's
    predictors first when it has none (a sweep finished before predictors existed).  A predictor
    already in ``out`` is replaced only with ``overwrite``."""
    results, out = Path(results), Path(out)
    if (out / INFO_FILE).exists() and not overwrite:
        raise PredictorError(f"--out {out} holds a predictor already; choose another directory, or --overwrite it")
    source, why = chosen_predictor(results, method, seed, log=log)
    if out.exists() and any(out.iterdir()) and not (out / INFO_FILE).exists():
        raise PredictorError(f"--out {out} is a non-empty directory without a predictor in it; choose a new or empty directory")
    predictor = Predictor.load(source, device="cpu")
    predictor.save(out, provenance={"exported_from": str(source.resolve()), "chosen_by": why}, overwrite=overwrite)
    log(f"{method}: {source.name} ({'chosen on validation data' if seed is None else why}) -> {out}")
    warning = chance_line(predictor)
    if warning is not None:
        log(warning)
    return out


def chosen_predictor(results: str | os.PathLike, method: str, seed: int | None = None, log=print) -> tuple[Path, str]:
    """The directory of ``method``'s predictor in the sweep in ``results`` -- its final model chosen on
    validation data (``CHOICE_RULE``), or seed ``seed``'s -- and why it is that one; builds the sweep's
    predictors first when it has none (a sweep finished before predictors existed)."""
    results = Path(results)
    index = read_index(results)
    if index is None:
        log(f"{results} has no predictors yet: exporting its final models")
        lock = ResultsLock(results)
        try:
            lock.acquire()
        except ResultsInUse as error:
            raise PredictorError(f"{error}: export once the sweep has finished") from None
        try:
            index = export_sweep(results, log=log)
        finally:
            lock.release()
    mine = {entry["seed"]: entry for entry in index["predictors"] if entry["method"] == method}
    if not mine:
        methods = sorted({entry["method"] for entry in index["predictors"]})
        raise PredictorError(f"--method {method}: the sweep in {results} has no final model of it (it has: {', '.join(methods) or 'none'})")
    if seed is None:
        entry, why = next(e for e in mine.values() if e["name"] == index["chosen"][method]), index["rule"]
    elif seed in mine:
        entry, why = mine[seed], f"--seed {seed}"
    else:
        raise PredictorError(f"--seed {seed}: the sweep's final {method} models have the seeds {', '.join(map(str, sorted(mine)))}")
    return results / entry["directory"], why
