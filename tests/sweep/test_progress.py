"""The sweep's progress lines: time stamps, the overall trial counter and its estimate, and the
base model's epochs thinned (the lines of a real sweep: tests/sweep/test_sweep.py)."""

from dpsm_ray.sweep.progress import Progress, clock_text
from dpsm_ray.timing import duration_text
from dpsm_ray.train.lines import EpochLine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(**options) -> tuple[Progress, list[str], Clock]:
    lines, clock = [], Clock()
    return Progress(lines.append, clock=clock, **options), lines, clock


def test_clock_and_duration_texts():
    assert [clock_text(s) for s in (0, 59.9, 61, 3600 + 62, 36000)] == ["0:00:00", "0:00:59", "0:01:01", "1:01:02", "10:00:00"]
    assert [duration_text(s) for s in (4.4, 59.6, 185, 7800)] == ["4s", "1m00s", "3m05s", "2h10m"]


def test_every_line_carries_the_time_since_the_sweep_started():
    log, lines, clock = progress()
    log("search-ce: 4 trials")
    clock.now += 75
    log("final: 2 methods")
    assert lines == ["[0:00:00] search-ce: 4 trials", "[0:01:15] final: 2 methods"]


def test_the_counter_spans_the_stages_and_the_estimate_is_trials_left_times_this_run_s_time_per_ended_trial():
    log, _, clock = progress()
    log.plan(10)
    log.already_ended(2)  # a resumed sweep: two trials ended in an earlier run
    clock.now += 35  # waiting for Ray: not counted
    log.trial_started()
    log.trial_started()  # two side by side
    clock.now += 390
    assert log.trial_ended() == "trial 3/10"  # no estimate from the first trial alone
    clock.now += 20
    # 6 left x (410 s / 2 trials ended): not 6 x 20 s, the time between the two ends
    assert log.trial_ended() == "trial 4/10, about 20m30s left"
    log.trial_started()
    log.trial_started()
    clock.now += 400
    assert log.trial_ended() == "trial 5/10, about 22m30s left"  # 5 left x 810 s / 3
    log.replan(planned=4, actual=3)  # a method whose every search trial failed: one final trial fewer
    assert log.total == 9
    for _ in range(3):
        log.trial_ended()
    assert log.trial_ended() == "trial 9/9"  # nothing left: no estimate


def test_a_trial_that_ended_without_a_start_seen_starts_the_estimate_s_clock():
    log, _, clock = progress()
    log.plan(4)
    clock.now += 10
    assert log.trial_ended() == "trial 1/4"
    clock.now += 30
    assert log.trial_ended() == "trial 2/4, about 30s left"  # 2 left x 30 s / 2


def test_no_estimate_before_a_trial_of_this_run_ended():
    log, _, _ = progress()
    log.plan(4)
    log.already_ended(1)
    assert log.left_seconds() is None


def epoch(number: int, epochs: int = 20, seconds: float = 2.0) -> EpochLine:
    return EpochLine(f"[ce] epoch {number:>3}/{epochs}", epoch=number, epochs=epochs, seconds=seconds, val_set_size=1.5, method="ce")


def test_the_base_models_epochs_show_once_per_interval_and_never_the_last():
    log, lines, clock = progress(epoch_every_s=30)
    for number in range(1, 21):
        clock.now += 2.0
        log(epoch(number))
    # epochs end at 2, 4, ... 40 s; the first line 30 s after epoch 1, i.e. at epoch 16 (32 s)
    assert lines == ["[0:00:32] base model: epoch 16/20  val size 1.50  (2.0s per epoch, about 8s left)"]
    assert isinstance(epoch(1), str) and epoch(3) == "[ce] epoch   3/20"  # still the loop's own line for everyone else


def test_a_trial_resumed_from_its_checkpoint_counts_as_the_share_of_its_epochs_run_now():
    """Two trials resumed after 9 and 8 of their 10 epochs end 20 s apart: 0.3 of a trial's work
    in 40 s, not two trials (counted whole, they said "about 4m00s left", not 27 minutes)."""
    log, _, clock = progress()
    log.plan(42)
    log.already_ended(28)
    log.trial_started()
    log.trial_started()
    clock.now += 20
    assert log.trial_ended(share=0.1) == "trial 29/42"
    clock.now += 20
    assert log.trial_ended(share=0.2) == "trial 30/42, about 26m40s left"  # 12 left x 40 s / 0.3
    log.trial_started()
    clock.now += 160
    assert log.trial_ended() == "trial 31/42, about 28m12s left"  # 11 left x 200 s / 1.3
    assert Progress(print).trial_ended(share=0.0) == "trial 1/0"  # no work counted: no estimate, no division by zero


def test_the_sweep_s_callback_takes_a_trial_s_share_from_the_epoch_it_resumed_after(tmp_path):
    from types import SimpleNamespace

    from dpsm_ray.config import TrainConfig
    from dpsm_ray.storage.layout import Ledger
    from dpsm_ray.sweep.stage import RESUMED, LedgerCallback

    def trial(index: int) -> SimpleNamespace:
        point = {"stage": "final", "index": index, "overrides": {"seed": index}}
        return SimpleNamespace(trial_id=f"t{index}", config={"point": point, "bases": {"final": TrainConfig(epochs=10).to_dict()}})

    callback = LedgerCallback(Ledger(tmp_path), [], stopper=None, log=Progress(print))
    resumed, fresh = trial(0), trial(1)
    callback.on_trial_result(0, [], resumed, {"epoch": 8, RESUMED: True})
    assert callback.share_now(resumed, resumed.config["point"]) == 0.2
    assert callback.share_now(fresh, fresh.config["point"]) == 1.0


def test_a_progress_log_pickles_without_where_it_writes():
    """Tune pickles its callbacks, which hold the sweep's log; where the log writes may not pickle
    (a lambda, or print where Ray Train's or Serve's redirection replaced builtins.print)."""
    import pickle

    progress = Progress(lambda line: None)
    progress.plan(3)
    again = pickle.loads(pickle.dumps(progress))
    assert again.total == 3 and again.emit is None and progress.emit is not None
