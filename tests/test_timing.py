import subprocess
import sys
import time
from pathlib import Path

from dpsm_ray.timing import Stopwatch, process_started_at


def test_a_stopwatch_sums_each_part_over_its_repeats():
    clock = Stopwatch()
    for _ in range(3):
        with clock("nap"):
            time.sleep(0.01)
    clock.add("given", 2.5)
    assert set(clock.seconds) == {"nap", "given"} and clock.seconds["given"] == 2.5
    assert 0.03 <= clock.seconds["nap"] < 1.0
    try:
        with clock("raised"):
            raise KeyError
    except KeyError:
        pass
    assert clock.seconds["raised"] >= 0  # a part that raised is still counted


def test_a_part_timed_inside_another_counts_for_itself_alone():
    clock = Stopwatch()
    started = time.perf_counter()
    with clock("outer"):
        time.sleep(0.01)
        with clock("inner"):
            time.sleep(0.2)
        time.sleep(0.01)
    covered = time.perf_counter() - started
    assert clock.seconds["inner"] >= 0.2 and 0.02 <= clock.seconds["outer"] < 0.2  # the outer part without the inner one's 0.2 s
    assert abs(clock.seconds["outer"] + clock.seconds["inner"] - covered) < 1e-3  # they add up to the time covered


def test_the_process_start_is_before_now_and_after_the_machine_booted():
    started = process_started_at()
    if not Path("/proc/self/stat").exists():
        assert started is None
        return
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert time.time() - uptime <= started <= time.time()
    # this test process has been running at least as long as it took to import pytest and this module
    assert started <= time.time() - 0.05


EXITING = """
import atexit, sys
from dpsm_ray.timing import skip_final_collection

class Cycle:
    def __del__(self):
        print("finalised", flush=True)

cycle = Cycle()
cycle.me = cycle  # freed only by a garbage collection
del cycle
import gc; gc.disable()  # none before the exit: only the interpreter's final ones could free it
atexit.register(print, "atexit ran", flush=True)
if sys.argv[1] == "skip":
    before = atexit._ncallbacks()
    skip_final_collection(); skip_final_collection()
    print("added", atexit._ncallbacks() - before)
with open(sys.argv[2], "w") as out:
    out.write("written")
"""


def test_skipping_the_final_collection_leaves_only_cycles_unfinalised_and_atexit_work_done(tmp_path):
    """The commands' exit (2.6 s -> 0.4 s after a sweep): the interpreter's last collections are
    left out, after every atexit handler -- registered once, however often asked."""
    said = {}
    for mode in ("keep", "skip"):
        run = subprocess.run([sys.executable, "-c", EXITING, mode, str(tmp_path / mode)], capture_output=True, text=True, check=True)
        said[mode] = run.stdout.split()
        assert (tmp_path / mode).read_text() == "written"
    assert said["keep"] == ["atexit", "ran", "finalised"]
    assert said["skip"] == ["added", "1", "atexit", "ran"]
