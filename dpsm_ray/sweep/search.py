"""How a search proposes trials and stops poor ones, resumable from the sweep's record alone.

``MethodStudy`` is one method's Optuna study, driven with Optuna's public ask/tell API on a storage
the sweep owns.  A proposal is a pure function of the sweep seed, the trial's number and the study's
finished trials (each parameter of each trial is drawn by a sampler seeded for it), so a resumed
search proposes what an uninterrupted one would have; a trial the study holds but the ledger does not (the driver died
while it ran) is proposed again with its own parameters; telling a finished trial again is skipped.
``dpsm_ray.sweep.stage.StageSearcher`` hands the proposals of one or more studies to Tune.

``AshaStopper`` is asynchronous successive halving (Li et al. 2020) over epochs, on the validation
set size: a trial reaching a rung (``grace_period * reduction_factor**k`` epochs, below its last
epoch) goes on only if its value there is within the best ``1 / reduction_factor`` of the values
that the trials proposed before it reached at that rung (numpy's linear percentile, as Tune's
ASHA computes its cutoff).  Judging against earlier trials only makes
every decision a function of the ledger, so a resumed sweep repeats it.
"""

from __future__ import annotations

import math
import warnings

import numpy
import optuna
from ray import tune

from dpsm_ray.seeding import derive_seed
from dpsm_ray.sweep.space import Range
from dpsm_ray.train.ray_train import FINISHED, RESUMED

# The Parquet/report column that a trial is scored on, and the one constrained.
OBJECTIVE = "val_set_size"
CONSTRAINED = "val_coverage"
# TPE and GP start from this many trials that do not model the others (Optuna's default is 10;
# searches here are short): random ones, or the sweep's Sobol points for ``sobol-tpe``
STARTUP_TRIALS = 4
# A trial's constraint values, as the system attribute that Optuna's samplers write for a
# constraints_func (optuna.study._constrained_optimization._CONSTRAINTS_KEY: a list, read by Optuna 5
# as ``trial.constraints == {"0": value}``) and the only one optuna-dashboard shows (0.21,
# _serializer.py: ``trial_system_attrs.get("constraints", [])``); the ``constraints:<name>`` keys
# of ``trial.set_constraint`` are invisible to it.  One value: floor - val_coverage, feasible <= 0.
_CONSTRAINTS_KEY = "constraints"


class MethodStudy:
    """One method's Optuna study: ``propose`` the next trial, ``tell`` how one ended.

    Samplers (``sampler``): ``tpe``, Optuna's TPE (multivariate in Optuna 5) after ``STARTUP_TRIALS``
    random ones; ``random``; ``gp``, Optuna's ``GPSampler`` (built for budgets of 10-50 trials) after
    the same random start, with the coverage constraint; ``sobol``, a scrambled Sobol sequence over
    every knob of ``DEFAULT_RANGES`` seeded by the sweep alone (``_sobol_point``), so that trial n of
    every method draws the same value of a knob they share; ``sobol-tpe``, TPE after
    ``STARTUP_TRIALS`` of those Sobol points instead of random ones (every method's start shared)."""

    def __init__(self, storage: str | optuna.storages.BaseStorage, name: str, method: str, space: dict[str, Range], *, sampler: str,
                 seed: int, total: int) -> None:
        self.name, self.method, self.space, self.sampler, self.seed, self.total = name, method, space, sampler, seed, total
        # a URL (the sweep's database), or a storage object (bench/search_quality.py's in-memory replays)
        self.storage = optuna.storages.RDBStorage(storage) if isinstance(storage, str) else storage
        self.study = optuna.create_study(study_name=name, storage=self.storage, direction="minimize", load_if_exists=True)
        self.study_id = self.storage.get_study_id_from_name(name)

    def __getstate__(self) -> dict:
        """Without its storage: Tune pickles its searcher and callbacks (tuner.pkl), and the
        storage's URL may carry a password.  Nothing is ever restored from those pickles."""
        return {k: v for k, v in self.__dict__.items() if k not in ("storage", "study")}

    def sampler_for(self, number: int, parameter: str) -> optuna.samplers.BaseSampler:
        """The sampler that draws ``parameter`` of trial ``number``: seeded for exactly that, so the
        draw does not depend on what was drawn before it (a driver may die between two of them)."""
        seed = derive_seed(self.seed, self.sampler, self.method, number, parameter) % 2**32
        startup = min(STARTUP_TRIALS, self.total)
        if self.sampler == "tpe" or (self.sampler == "sobol-tpe" and number >= startup):
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
        if self.sampler == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup, warn_independent_sampling=False,
                                             independent_sampler=optuna.samplers.RandomSampler(seed=seed))
        if self.sampler in ("sobol", "sobol-tpe"):
            point = _sobol_point(self.seed, number)
            with warnings.catch_warnings():  # experimental since Optuna 2.4, unchanged since
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.samplers.PartialFixedSampler({parameter: point[parameter]}, optuna.samplers.RandomSampler(seed=seed))
        return optuna.samplers.RandomSampler(seed=seed)

    def propose(self, exclude: set[int]) -> tuple[int, dict] | None:
        """The lowest-numbered trial of the study not in ``exclude`` (ended or handed out), else a
        new one while the study has fewer than ``total``; None when there is nothing left."""
        trials = self.study.get_trials(deepcopy=False)
        waiting = sorted(t.number for t in trials if t.number not in exclude)
        if waiting:
            trial = optuna.Trial(self.study, self.storage.get_trial_id_from_study_id_trial_number(self.study_id, waiting[0]))
        elif len(trials) < self.total:
            trial = self.study.ask()
        else:
            return None
        params = {}
        for name, bounds in self.space.items():  # a value the study holds already is kept
            self.study.sampler = self.sampler_for(trial.number, name)
            params[name] = trial.suggest_float(name, bounds.low, bounds.high, log=bounds.log)
        return trial.number, params

    def tell(self, number: int, *, status: str, value: float | None, coverage: float | None, floor: float, attributes: dict) -> None:
        """Record how trial ``number`` ended: complete (with its value and the coverage
        constraint, feasible when ``floor - coverage <= 0``), pruned (stopped early) or failed;
        ``attributes`` become its user attributes (the join keys to the Parquet rows).
        A trial the study already holds as finished is left as it is."""
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        if self.storage.get_trial(trial_id).state.is_finished():
            return
        trial = optuna.Trial(self.study, trial_id)
        for key, attribute in attributes.items():
            trial.set_user_attr(key, attribute)
        if status != "failed" and coverage is not None and math.isfinite(coverage) and not self.storage.get_trial(trial_id).constraints:
            self.storage.set_trial_system_attr(trial_id, _CONSTRAINTS_KEY, [floor - coverage])
        if status == "ok" and value is not None and math.isfinite(value):
            self.study.tell(number, value, skip_if_finished=True)
        else:
            state = optuna.trial.TrialState.PRUNED if status == "stopped" else optuna.trial.TrialState.FAIL
            self.study.tell(number, state=state, skip_if_finished=True)


def _sobol_point(seed: int, number: int) -> dict[str, float]:
    """Point ``number`` of the sweep's scrambled Sobol sequence (scipy's, seeded by the sweep seed
    alone), one coordinate per knob of ``DEFAULT_RANGES``, mapped into its range (log-uniform or
    uniform): the ``sobol`` sampler's trial ``number`` for every method alike."""
    from scipy.stats import qmc

    from dpsm_ray.cards import DEFAULT_RANGES

    # the first 2**m points (m the least with 2**m > number): the sequence's prefix, as Sobol's balance wants it drawn
    sequence = qmc.Sobol(d=len(DEFAULT_RANGES), scramble=True, seed=derive_seed(seed, "sobol") % 2**32)
    unit = sequence.random_base2(number.bit_length())[number]
    point = {}
    for (knob, bounds), u in zip(DEFAULT_RANGES.items(), unit):
        if bounds.log:
            value = math.exp(math.log(bounds.low) + u * (math.log(bounds.high) - math.log(bounds.low)))
        else:
            value = bounds.low + u * (bounds.high - bounds.low)
        point[knob] = min(max(value, bounds.low), bounds.high)
    return point


def rungs(grace_period: int, reduction_factor: int, epochs: int) -> list[int]:
    """The epochs at which ASHA judges a trial of ``epochs`` epochs (never its last)."""
    found, rung = [], grace_period
    while rung < epochs:
        found.append(rung)
        rung *= reduction_factor
    return found


class AshaStopper(tune.Stopper):
    """ASHA's stop rule for one stage's trials, as a Tune stopper (module docstring).

    ``history`` is every trial's epoch rows known from the ledger (trials that ended, and the ones
    an interrupted run left part-way), ``{index: {epoch: value}}``."""

    def __init__(self, grace_period: int | None, reduction_factor: int, epochs: int, history: dict[int, dict[int, float]]) -> None:
        self.rungs = rungs(grace_period, reduction_factor, epochs) if grace_period else []
        self.reduction_factor = reduction_factor
        self.values = {rung: {i: v[rung] for i, v in history.items() if rung in v} for rung in self.rungs}
        self.stopped: set[int] = set()

    def __call__(self, trial_id: str, result: dict) -> bool:
        if result.get(FINISHED) or "epoch" not in result or "trial_index" not in result:
            return False
        index, epoch = int(result["trial_index"]), int(result["epoch"])
        if epoch in self.values and OBJECTIVE in result:
            self.values[epoch][index] = float(result[OBJECTIVE])
        # a rung is judged when the trial reaches it; a resumed trial's rungs again, where the
        # interrupted run may have stopped it just before the driver died
        judged = [r for r in self.rungs if r <= epoch] if result.get(RESUMED) else [epoch]
        for rung in (r for r in judged if index in self.values.get(r, {})):
            earlier = [v for i, v in self.values[rung].items() if i < index and math.isfinite(v)]
            if earlier and self.values[rung][index] > float(numpy.percentile(earlier, 100 / self.reduction_factor)):
                self.stopped.add(index)
                return True
        return False

    def stop_all(self) -> bool:
        return False  # the experiment's StageStoppers halts it


class StageStoppers(tune.Stopper):
    """The ``AshaStopper`` of each stage of one experiment, each judging its own stage's trials (a
    trial's reports name its stage: ``trial_stage``), and ``halt()`` to end the experiment."""

    def __init__(self, stoppers: dict[str, AshaStopper]) -> None:
        self.stoppers = stoppers
        self.halted = False

    def __call__(self, trial_id: str, result: dict) -> bool:
        stopper = self.stoppers.get(result.get("trial_stage"))
        return stopper is not None and stopper(trial_id, result)

    def stopped(self, stage: str, index: int) -> bool:
        """Whether ASHA stopped trial ``index`` of ``stage``."""
        return index in self.stoppers[stage].stopped

    def stop_all(self) -> bool:
        return self.halted

    def halt(self) -> None:
        """End the experiment at the next step (a full disk: nothing more can be written)."""
        self.halted = True


__all__ = ["CONSTRAINED", "OBJECTIVE", "RESUMED", "AshaStopper", "MethodStudy", "StageStoppers", "rungs"]
