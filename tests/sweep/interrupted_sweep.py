"""``sweeps/digits.py`` that stops itself at a chosen instant: Ctrl-C (SIGINT) or ``kill -9``
(SIGKILL).  A helper script for the resume tests: a timer cannot hit "as a trial finishes" or
"half-way through a file write" reliably; a hook in the sweep's own code can.

    python interrupted_sweep.py POINT [digits.py options]

POINT is one of
    search:<stage>:<n>       Ctrl-C when trial n (1-based) of a stage reports its first epoch
    between:final            Ctrl-C as the final stage is chosen: every search trial has ended,
                             no final trial has started (one Tune experiment runs both)
    finishing:<stage>:<n>    Ctrl-C when trial n of a stage sends its final report
    kill-write:<k>           kill -9 during this process's k-th file write: half the bytes are in
                             the temporary file, the target not yet replaced
    kill-recorded:<stage>:<n>  kill -9 right after trial n's record is written, before the
                             Optuna study is told
    kill-told:<stage>:<n>    kill -9 right after the study is told (as its "done" line prints)
    kill-asked:<stage>:<n>   kill -9 while trial n is being proposed: its first parameter is in
                             the study, the others are not
    term:<point>             at a Ctrl-C point above, SIGTERM instead (``kill``, a scheduler's preemption)
    kill-base-model          kill -9 as the first epoch line of a base model comes back from the
                             Ray task training it (its checkpoint written, the task still running)
    trace-writes             no interruption; print each file write's target to stderr (to choose
                             kill-write instants)
    none                     no interruption
"""

import os
import re
import runpy
import signal
import sys
from pathlib import Path

from dpsm_ray.sweep import driver, search, stage
from dpsm_ray.train.lines import EpochLine
from dpsm_ray.train.ray_train import FINISHED

ROOT = Path(__file__).resolve().parents[2]
TEMPORARY = re.compile(r"^\..+\.\d+\.tmp$")


STOP = [signal.SIGINT]  # what ctrl_c sends: SIGTERM for a term: point


def ctrl_c() -> None:
    os.kill(os.getpid(), STOP[0])


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def trial_number(callback, trial) -> int:
    return trial.config["point"]["index"] + 1


def interrupt_at(point: str) -> None:
    if point.startswith("term:"):
        STOP[0], point = signal.SIGTERM, point.removeprefix("term:")
    kind, _, where = point.partition(":")
    if kind in ("search", "finishing"):
        stage_name, number = where.rsplit(":", 1)
        on_result = stage.LedgerCallback.on_trial_result

        def hooked(self, iteration, trials, trial, result, **info):
            if self.stage_of(trial).name == stage_name and trial_number(self, trial) == int(number):
                if (kind == "search" and result.get("epoch") == 1 and not result.get(FINISHED)) or (kind == "finishing" and result.get(FINISHED)):
                    ctrl_c()
            return on_result(self, iteration, trials, trial, result, **info)

        stage.LedgerCallback.on_trial_result = hooked
    elif point == "between:final":
        final_stage = driver.final_stage

        def hooked_final_stage(*args, **kwargs):
            ctrl_c()
            return final_stage(*args, **kwargs)

        driver.final_stage = hooked_final_stage
    elif kind in ("kill-write", "trace-writes"):
        replace, count = os.replace, [0]

        def hooked_replace(source, target, *args, **kwargs):
            if TEMPORARY.match(Path(source).name):
                count[0] += 1
                if kind == "trace-writes":
                    print(f"write {count[0]}: {target}", file=sys.stderr, flush=True)
                elif count[0] == int(where):
                    size = os.path.getsize(source)
                    os.truncate(source, size // 2)
                    kill()
            return replace(source, target, *args, **kwargs)

        os.replace = hooked_replace
    elif kind in ("kill-recorded", "kill-told"):
        stage_name, number = where.rsplit(":", 1)
        write_record, tell = stage.Ledger.write_record, search.MethodStudy.tell

        def hooked_record(self, name, index, record):
            write_record(self, name, index, record)
            if kind == "kill-recorded" and name == stage_name and index + 1 == int(number):
                kill()

        def hooked_tell(self, number_, **kwargs):
            tell(self, number_, **kwargs)
            if kind == "kill-told" and f"search-{self.method}" == stage_name and number_ + 1 == int(number):
                kill()

        stage.Ledger.write_record = hooked_record
        search.MethodStudy.tell = hooked_tell
    elif kind == "kill-asked":
        stage_name, number = where.rsplit(":", 1)
        sampler_for = search.MethodStudy.sampler_for
        drawn = []

        def hooked_sampler(self, number_, parameter):
            if f"search-{self.method}" == stage_name and number_ + 1 == int(number):
                drawn.append(parameter)
                if len(drawn) == 2:  # the first parameter is stored; die before the second
                    kill()
            return sampler_for(self, number_, parameter)

        search.MethodStudy.sampler_for = hooked_sampler
    elif point == "kill-base-model":
        with_base_models = driver.with_base_models

        def hooked_base_models(spec, seeds, results, log):
            def killing(line):
                log(line)
                if isinstance(line, EpochLine):  # the base model's task has checkpointed an epoch
                    kill()

            return with_base_models(spec, seeds, results, killing)

        driver.with_base_models = hooked_base_models
    elif kind != "none":
        raise SystemExit(f"unknown interruption point {point!r}")


if __name__ == "__main__":
    interrupt_at(sys.argv[1])
    digits = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))
    sys.exit(digits["main"]("digits", "digits sweep, interrupted", digits["DEFAULTS"], sys.argv[2:]))
