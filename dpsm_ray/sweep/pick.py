"""The pick: which search trial's configuration each method's final models re-train
(docs/results.md), from the sweep's Parquet files."""

from __future__ import annotations

import json
from pathlib import Path

from dpsm_ray.storage.layout import TUNE, Results


def best_overrides(results: Path, method: str, searched, log) -> dict | None:
    """The chosen configuration of ``method`` (docs/results.md, "the pick"):

    1. the finished feasible trial (validation coverage >= the floor) with the lowest validation
       set size;
    2. replaced by a feasible trial that ASHA stopped after e epochs only if its set size after e
       epochs was lower than the pick's own after e epochs (the largest such margin wins);
    3. without a finished feasible trial, the feasible stopped trial that ran longest, then the
       smallest set size; without any feasible trial, the highest coverage (finished trials first).

    ``searched``: the configuration fields the search set (its knobs, or its grid's axes), what the
    pick returns; feasible means the sweep's coverage floor (``CoverageFloor``, from its sweep.json).
    None (and a warning) when every search trial of ``method`` failed.  Ties (common on small
    validation splits) go to the trial proposed first, so the sweep seed fixes the choice."""
    reader = Results(results)
    trials = reader.trials
    search = trials[(trials.stage == "search") & (trials.method == method)]
    finished, stopped = search[search.status == "ok"], search[search.status == "stopped"]
    if finished.empty and stopped.empty:
        log(
            f"warning: every search trial of {method} failed (errors in trials.parquet and under {results / TUNE}); {method} is left out"
            " of the final stage"
        )
        return None
    feasible, feasible_stopped = finished[finished.feasible == True], stopped[stopped.feasible == True]  # noqa: E712 (nullable)
    if not feasible.empty:
        chosen = feasible.sort_values(["val_set_size", "trial_index"]).iloc[0]
        if not feasible_stopped.empty:
            epochs = reader.epochs
            at_epoch = epochs[epochs.trial_id == chosen.trial_id].set_index("epoch").val_set_size
            margin = feasible_stopped.epochs_completed.map(at_epoch) - feasible_stopped.val_set_size
            ahead = feasible_stopped.assign(margin=margin)[margin > 0]
            if not ahead.empty:
                chosen = ahead.sort_values(["margin", "trial_index"], ascending=[False, True]).iloc[0]
                log(
                    f"{method}: trial {chosen.trial_id}, stopped after {chosen.epochs_completed} epochs, was {chosen.margin:.3f} ahead of"
                    " the best finished trial there"
                )
    elif not feasible_stopped.empty:
        chosen = feasible_stopped.sort_values(["epochs_completed", "val_set_size", "trial_index"], ascending=[False, True, True]).iloc[0]
    else:
        floor = f"{reader.floor:g}" if reader.floor is not None else "the coverage floor"
        log(f"warning: no {method} trial reached validation coverage {floor}; using the one with the highest coverage")
        pool = finished if not finished.empty else stopped
        chosen = pool.sort_values(["val_coverage", "trial_index"], ascending=[False, True]).iloc[0]
    config = json.loads(chosen.config_json)
    overrides = {name: (tuple(config[name]) if isinstance(config[name], list) else config[name]) for name in searched}
    indexed = chosen.trial_index == chosen.trial_index  # NaN: no index
    which = f"search trial {int(chosen.trial_index) + 1}" if indexed else f"trial {chosen.trial_id}"
    log(f"best {method}: {which}  val size {chosen.val_set_size:.3f}  val cov {chosen.val_coverage:.3f}  "
        + "  ".join(f"{k}={f'{v:.4g}' if isinstance(v, float) else v}" for k, v in overrides.items()))
    return overrides
