"""``sweeps/digits.py`` that presses Ctrl-C on itself at a chosen point (a helper script for the
resume tests: a timer cannot hit "as a trial finishes" reliably; a hook in the sweep's own
callbacks can).

    python interrupted_sweep.py POINT [digits.py options]

POINT is one of
    search:<stage>:<n>      when trial n (1-based) of a stage reports its first epoch
    between:<method>        just before <method>'s search starts (after the previous stage)
    finishing:<stage>:<n>   when trial n of a stage sends its final report (results and last
                            checkpoint), before Tune has processed that checkpoint
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from dpsm_ray.sweep import protocol
from dpsm_ray.sweep.trials import ProgressPrinter, proposal_order
from dpsm_ray.train.ray_train import FINISHED

ROOT = Path(__file__).resolve().parents[2]


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def interrupt_at(point: str) -> None:
    kind, _, where = point.partition(":")
    if kind in ("search", "finishing"):
        stage, number = where.rsplit(":", 1)
        on_result = ProgressPrinter.on_trial_result

        def hooked(self, iteration, trials, trial, result, **info):
            if self.label == stage and proposal_order(trials).index(trial) + 1 == int(number):
                if (kind == "search" and result.get("epoch") == 1 and not result.get(FINISHED)) or (kind == "finishing" and result.get(FINISHED)):
                    ctrl_c()
            return on_result(self, iteration, trials, trial, result, **info)

        ProgressPrinter.on_trial_result = hooked
    elif kind == "between":
        search_method = protocol.search_method

        def hooked_search(spec, base, *args, **kwargs):
            if base.method == where:
                ctrl_c()
            return search_method(spec, base, *args, **kwargs)

        protocol.search_method = hooked_search
    else:
        raise SystemExit(f"unknown interruption point {point!r}")


if __name__ == "__main__":
    interrupt_at(sys.argv[1])
    digits = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))
    sys.exit(digits["main"]("digits", "digits sweep, interrupted", digits["DEFAULTS"], sys.argv[2:]))
