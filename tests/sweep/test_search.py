"""How a search proposes trials and stops poor ones, from the sweep's own record (no Ray)."""

import math

import optuna
import pytest

from dpsm_ray.sweep.search import STARTUP_TRIALS, AshaStopper, MethodStudy, StageStoppers, rungs
from dpsm_ray.sweep.stage import Stage, StageSearcher
from dpsm_ray.config import TrainConfig
from dpsm_ray.sweep.space import Range
from dpsm_ray.train.ray_train import FINISHED, RESUMED

SPACE = {"conformal_weight": Range(0.01, 5.0), "lr": Range(0.001, 0.1), "quantile_lr": Range(1e-4, 0.5)}


def study(tmp_path, name="s", total=6, db="optuna.db", **kwargs) -> MethodStudy:
    return MethodStudy(f"sqlite:///{tmp_path / db}", name, "dpsm", SPACE, sampler=kwargs.get("sampler", "tpe"), seed=kwargs.get("seed", 0), total=total)


def run_search(s: MethodStudy, values: dict[int, float], stop_after: int | None = None) -> list[dict]:
    """Propose and tell trials in order, as a sweep with one trial at a time does."""
    ended, proposals = set(), []
    while (proposal := s.propose(ended)) is not None:
        number, params = proposal
        proposals.append(params)
        if stop_after is not None and number == stop_after:
            break
        s.tell(number, status="ok", value=values[number], coverage=0.9, floor=0.88, attributes={})
        ended.add(number)
    return proposals


def test_proposals_are_a_function_of_the_seed_and_the_finished_trials(tmp_path):
    values = dict(enumerate([1.3, 1.1, 1.2, 0.9, 1.0, 0.95]))
    first = run_search(study(tmp_path, db="a.db"), values)
    again = run_search(study(tmp_path, db="b.db"), values)
    assert len(first) == 6 and first == again  # TPE after its 4 random start-up trials as well
    other_seed = run_search(study(tmp_path, db="c.db", seed=1), values)
    assert other_seed != first
    for params in first:
        assert all(SPACE[k].low <= v <= SPACE[k].high for k, v in params.items())


def test_a_trial_the_study_holds_without_a_record_is_proposed_again_with_its_parameters(tmp_path):
    """The driver died while trial 2 ran: Optuna has it RUNNING, the ledger has no record."""
    values = dict(enumerate([1.3, 1.1, 1.2, 0.9, 1.0, 0.95]))
    uninterrupted = run_search(study(tmp_path, db="a.db"), values)
    interrupted = study(tmp_path, db="b.db")
    before = run_search(interrupted, values, stop_after=2)
    resumed = study(tmp_path, db="b.db")  # a new driver: a new object on the same storage
    after = run_search_from(resumed, values, ended={0, 1})
    assert before + after[1:] == uninterrupted and after[0] == before[-1]


def run_search_from(s, values, ended):
    ended, proposals = set(ended), []
    while (proposal := s.propose(ended)) is not None:
        number, params = proposal
        proposals.append(params)
        s.tell(number, status="ok", value=values[number], coverage=0.9, floor=0.88, attributes={})
        ended.add(number)
    return proposals


def test_a_trial_proposed_part_way_before_a_kill_gets_the_parameters_it_would_have_had(tmp_path):
    """Killed between two parameters of one proposal: each parameter's draw is seeded for itself,
    so the ones drawn after the resume equal an uninterrupted proposal's."""
    values = dict(enumerate([1.3, 1.1, 1.2, 0.9, 1.0, 0.95]))
    uninterrupted = run_search(study(tmp_path, db="a.db"), values)
    partial = study(tmp_path, db="b.db")
    run_search(partial, values, stop_after=0)
    partial.tell(0, status="ok", value=values[0], coverage=0.9, floor=0.88, attributes={})
    trial = partial.study.ask()  # trial 1, with only its first parameter drawn
    partial.study.sampler = partial.sampler_for(trial.number, "conformal_weight")
    trial.suggest_float("conformal_weight", 0.01, 5.0, log=True)
    resumed = run_search_from(study(tmp_path, db="b.db"), values, ended={0})
    assert resumed == uninterrupted[1:]


def test_telling_is_idempotent_and_records_the_constraint_and_the_join_keys(tmp_path):
    s = study(tmp_path, total=3)
    number, _ = s.propose(set())
    s.tell(number, status="ok", value=1.2, coverage=0.86, floor=0.88, attributes={"run_id": "abc", "tune_trial_id": "t1"})
    s.tell(number, status="ok", value=9.9, coverage=0.99, floor=0.88, attributes={"run_id": "zzz"})  # a resumed driver tells again
    frozen = s.study.trials[0]
    assert frozen.state == optuna.trial.TrialState.COMPLETE and frozen.value == 1.2
    assert math.isclose(frozen.constraints["0"], 0.02) and frozen.user_attrs == {"run_id": "abc", "tune_trial_id": "t1"}
    assert frozen.system_attrs["constraints"] == [frozen.constraints["0"]]  # the list optuna-dashboard shows
    stopped, _ = s.propose({0})
    s.tell(stopped, status="stopped", value=1.5, coverage=0.9, floor=0.88, attributes={})
    failed, _ = s.propose({0, 1})
    s.tell(failed, status="failed", value=None, coverage=None, floor=0.88, attributes={})
    assert [t.state.name for t in s.study.trials] == ["COMPLETE", "PRUNED", "FAIL"]
    assert s.propose({0, 1, 2}) is None


@pytest.mark.parametrize("grace, factor, epochs, expected", [(5, 3, 10, [5]), (1, 2, 3, [1, 2]), (1, 2, 8, [1, 2, 4]), (5, 3, 5, []), (2, 3, 40, [2, 6, 18])])
def test_rungs_are_grace_times_powers_of_the_factor_before_the_last_epoch(grace, factor, epochs, expected):
    assert rungs(grace, factor, epochs) == expected


def report(index, epoch, size, **extra):
    return {"trial_index": index, "epoch": epoch, "val_set_size": size, **extra}


def test_asha_stops_a_trial_outside_the_best_third_of_the_earlier_trials_at_a_rung():
    stopper = AshaStopper(1, 3, epochs=4, history={})  # rungs at epochs 1 and 3
    assert not stopper("a", report(0, 1, 2.0))  # nothing earlier to compare with
    assert not stopper("b", report(1, 1, 1.0))
    assert not stopper("c", report(2, 1, 1.3))  # numpy's 33.3rd percentile of [2.0, 1.0] is 1.333...
    assert stopper("d", report(3, 1, 1.5))  # above the 33.3rd percentile of [2.0, 1.0, 1.3] (1.2)
    assert stopper.stopped == {3}
    assert not stopper("b", report(1, 2, 0.1))  # epoch 2 is no rung
    assert not stopper("e", report(4, 1, 1.0, **{FINISHED: True}))  # a final report is never judged


def test_asha_rebuilds_its_rungs_from_the_ledger_and_rejudges_a_resumed_trial():
    """The driver died right after ASHA stopped trial 2 at epoch 1 and before its record: the
    resumed trial re-reports its last epoch and is stopped again; the other decisions stand."""
    history = {0: {1: 1.0, 2: 0.9, 3: 0.8}, 1: {1: 0.95, 2: 0.85}, 2: {1: 3.0}}
    stopper = AshaStopper(1, 2, epochs=4, history=history)  # rungs at epochs 1 and 2
    assert stopper("x", report(2, 1, 3.0, **{RESUMED: True}))  # 3.0 > the median of [1.0, 0.95]
    assert not stopper("y", report(1, 2, 0.85, **{RESUMED: True}))  # within the best half at both rungs
    assert stopper.stopped == {2}


def test_a_halt_ends_the_experiment_and_no_stopper_without_asha_stops_a_trial():
    stopper = StageStoppers({"search-ce": AshaStopper(None, 2, epochs=5, history={})})
    assert not stopper.stop_all() and not stopper("a", report(0, 1, 100.0, trial_stage="search-ce")) and stopper.stoppers["search-ce"].rungs == []
    stopper.halt()
    assert stopper.stop_all()


def test_each_stage_of_an_experiment_is_judged_against_its_own_trials_alone():
    """The searches share one experiment: trial 1 of one stage is compared with that stage's trial
    0, never with another stage's trial 0 (their indices overlap)."""
    stopper = StageStoppers({"search-ce": AshaStopper(1, 2, epochs=4, history={}), "search-cut": AshaStopper(1, 2, epochs=4, history={})})
    assert not stopper("a", report(0, 1, 1.0, trial_stage="search-ce"))
    assert not stopper("b", report(0, 1, 5.0, trial_stage="search-cut"))
    assert not stopper("c", report(1, 1, 4.0, trial_stage="search-cut"))  # better than search-cut's 5.0 (worse than search-ce's 1.0)
    assert stopper("d", report(1, 1, 2.0, trial_stage="search-ce"))  # worse than search-ce's 1.0
    assert stopper.stopped("search-ce", 1) and not stopper.stopped("search-cut", 1)


def search_stage(name: str, s: MethodStudy) -> Stage:
    return Stage(name, TrainConfig(dataset="digits", method="dpsm"), s.total, tuple(SPACE), study=s)


def test_one_searcher_hands_out_each_study_s_trials_in_turn_as_sequential_searches_would(tmp_path):
    """The searches' trials run in one experiment: the first study's, then the next one's, each
    with the parameters its own search alone would have proposed."""
    first, second = study(tmp_path, "a", total=2), study(tmp_path, "b", total=2, seed=1)
    alone = [study(tmp_path, name, total=2, db=f"{name}.db", seed=seed) for name, seed in (("a", 0), ("b", 1))]
    expected = [("search-a", n, alone[0].propose(set(range(n)))[1]) for n in range(2)] + [("search-b", n, alone[1].propose(set(range(n)))[1]) for n in range(2)]
    searcher = StageSearcher([(search_stage("search-a", first), {}), (search_stage("search-b", second), {})])
    suggested = [searcher.suggest(f"t{i}") for i in range(4)]
    assert [(p["point"]["stage"], p["point"]["index"], p["point"]["overrides"]) for p in suggested] == expected
    assert all(set(p["bases"]) == {p["point"]["stage"]} for p in suggested)  # each trial carries its own stage's settings
    assert searcher.suggest("t4") == StageSearcher.FINISHED


def test_the_stages_that_need_the_searches_results_come_once_every_handed_out_trial_has_ended(tmp_path):
    """The final stage joins the searches' experiment: ``then`` is asked for it only when no
    search trial is running any more, and once; its points follow, skipping those that ended."""
    base = TrainConfig(dataset="digits", method="ce")
    final = Stage("final", base, 3, ("seed",), points=[{"seed": 0}, {"seed": 1}, {"seed": 2}])
    asked = []

    def then():
        asked.append(True)
        return [(final, {1: {"status": "ok"}})]  # trial 1 ended before an interruption

    searcher = StageSearcher([(search_stage("search-a", study(tmp_path, "a", total=2)), {})], then)
    assert [searcher.suggest(t)["point"]["index"] for t in ("t0", "t1")] == [0, 1]
    assert searcher.suggest("t2") is None and not asked  # wait: t0 and t1 still run
    searcher.on_trial_complete("t0")
    assert searcher.suggest("t2") is None and not asked
    searcher.on_trial_complete("t1", error=True)  # failed: ended all the same
    points = [searcher.suggest(t)["point"] for t in ("t2", "t3")]
    assert asked == [True] and [(p["stage"], p["index"], p["overrides"]) for p in points] == [("final", 0, {"seed": 0}), ("final", 2, {"seed": 2})]
    searcher.on_trial_complete("t2")
    searcher.on_trial_complete("t3")
    assert searcher.suggest("t4") == StageSearcher.FINISHED and asked == [True] and searcher.error is None


def test_an_error_choosing_the_next_stages_ends_the_experiment_and_is_kept_for_the_caller(tmp_path):
    def then():
        raise RuntimeError("every search trial failed")

    searcher = StageSearcher([(search_stage("search-a", study(tmp_path, "a", total=1)), {})], then)
    searcher.suggest("t0")
    searcher.on_trial_complete("t0")
    assert searcher.suggest("t1") == StageSearcher.FINISHED and str(searcher.error) == "every search trial failed"
    no_more = StageSearcher([(search_stage("search-b", study(tmp_path, "b", total=1)), {})], lambda: [])
    no_more.suggest("t0")
    no_more.on_trial_complete("t0")
    assert no_more.suggest("t1") == StageSearcher.FINISHED and no_more.error is None


def test_tune_s_pickle_of_the_searcher_leaves_out_the_sweep_behind_then(tmp_path):
    """Tune pickles its searcher (cloudpickle: a closure by value); ``then`` reaches the sweep's
    spec, whose Optuna storage URL may carry a password."""
    from ray import cloudpickle

    url = "postgresql://sweeper:s3cret-Pw@127.0.0.1/optuna"
    searcher = StageSearcher([(search_stage("search-a", study(tmp_path, "a", total=1)), {})], lambda: [url])
    assert b"s3cret-Pw" not in cloudpickle.dumps(searcher)
    assert searcher.then() == [url]  # the searcher in use keeps it


def test_a_tune_run_ended_by_a_full_disk_stops_the_sweep_with_the_full_disk_s_line(tmp_path):
    """Tune fails reading back its own files cut short by a full disk (an EOFError from a trial's
    empty error.pkl, seen once in a full run of test_a_full_disk_stops_the_sweep...): the line is
    the full disk's, not a traceback."""
    import os
    import subprocess

    from dpsm_ray.sweep.stage import out_of_space_line

    unrelated = EOFError("Ran out of input")
    full = OSError(28, "No space left on device")
    assert "No space left on device" in out_of_space_line(full, None, tmp_path)
    assert out_of_space_line(unrelated, "no space left on the device of /r/trials.parquet (0 bytes free)", tmp_path).startswith("no space left on the device of /r/")
    assert out_of_space_line(unrelated, None, tmp_path) is None  # room left: the error is another one
    if os.geteuid() != 0:
        return  # the nearly full device below is a small tmpfs, which needs root (CI runs as root)
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], check=True)
    try:
        assert out_of_space_line(unrelated, None, mount).startswith(f"no space left on the device of {mount / 'tune'} (")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("sampler", ["tpe", "random", "sobol", "sobol-tpe", "gp"])
def test_every_sampler_proposes_as_a_function_of_the_seed_and_resumes_past_its_random_start(tmp_path, sampler):
    """Killed while trial 6 ran (two trials past the four random ones): a new driver on the same storage
    proposes what an uninterrupted search would have, trial 6 again with its own parameters."""
    values = dict(enumerate([1.3, 1.1, 1.2, 0.9, 1.0, 0.95, 0.97, 0.92]))
    uninterrupted = run_search(study(tmp_path, db="a.db", total=8, sampler=sampler), values)
    assert run_search(study(tmp_path, db="b.db", total=8, sampler=sampler), values) == uninterrupted
    assert run_search(study(tmp_path, db="c.db", total=8, sampler=sampler, seed=1), values) != uninterrupted
    before = run_search(study(tmp_path, db="d.db", total=8, sampler=sampler), values, stop_after=6)
    after = run_search_from(study(tmp_path, db="d.db", total=8, sampler=sampler), values, ended=set(range(6)))
    assert before + after[1:] == uninterrupted and after[0] == before[-1]
    for params in uninterrupted:
        assert all(SPACE[k].low <= v <= SPACE[k].high for k, v in params.items())


def test_with_sobol_every_method_of_a_sweep_draws_the_same_lr_at_each_trial():
    """Fair by construction: trial n of CE and of DPSM take the same point of the sweep's one sequence,
    so CE's lr candidates are the first of DPSM's, and another sweep seed draws other ones."""
    def lrs(method, space, seed=0, total=8):
        s = MethodStudy(optuna.storages.InMemoryStorage(), method, method, space, sampler="sobol", seed=seed, total=total)
        return [params["lr"] for params in run_search(s, dict(enumerate([1.0] * total)))]

    ce = lrs("ce", {"lr": SPACE["lr"]}, total=4)
    dpsm = lrs("dpsm", SPACE)
    assert ce == dpsm[:4] and len(set(dpsm)) == 8
    assert lrs("ce", {"lr": SPACE["lr"]}, seed=1, total=4) != ce
    # a scrambled Sobol sequence covers the range evenly: each quarter of log(lr) holds 2 of the first 8
    quarters = [int(4 * math.log(lr / 0.001) / math.log(100)) for lr in dpsm]
    assert sorted(quarters) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_with_sobol_tpe_every_method_starts_from_the_sweep_s_sobol_points_then_models_its_own_trials():
    """``sobol-tpe``: the first STARTUP_TRIALS trials of CE and of DPSM are the ``sobol`` sampler's
    (the same lr at each), and after them TPE proposes from each method's own results."""
    def lrs(method, space, sampler, values):
        s = MethodStudy(optuna.storages.InMemoryStorage(), method, method, space, sampler=sampler, seed=0, total=len(values))
        return [params["lr"] for params in run_search(s, dict(enumerate(values)))]

    falling, rising = [1.3, 1.1, 1.2, 0.9, 1.0, 0.95, 0.97, 0.92], [0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    ce = lrs("ce", {"lr": SPACE["lr"]}, "sobol-tpe", falling)
    dpsm = lrs("dpsm", SPACE, "sobol-tpe", falling)
    assert ce[:STARTUP_TRIALS] == dpsm[:STARTUP_TRIALS] == lrs("ce", {"lr": SPACE["lr"]}, "sobol", falling)[:STARTUP_TRIALS]
    assert ce[STARTUP_TRIALS:] != lrs("ce", {"lr": SPACE["lr"]}, "sobol", falling)[STARTUP_TRIALS:]  # TPE's, not the sequence's
    assert lrs("ce", {"lr": SPACE["lr"]}, "sobol-tpe", rising)[STARTUP_TRIALS:] != ce[STARTUP_TRIALS:]  # and they follow the results
