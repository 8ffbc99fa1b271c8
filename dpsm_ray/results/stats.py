"""Per-seed paired comparisons with a Student t interval: the report's "DPSM against the best
baseline" and the fidelity study's tables (dpsm_ray/sweep/study.py) compute them here.

Two methods trained with the same seed start from the same base model and are evaluated on the same
calibration/test re-splits, so their difference is taken per seed (the mean over that seed's
re-splits); the seeds are the independent replicates, a model's re-splits are not.
"""

from __future__ import annotations

import math

T_LEVEL = 0.95


def t_interval(values: list[float], level: float = T_LEVEL) -> tuple[float, float, float]:
    """Mean and the two ends of a Student t interval for the mean of ``values`` (NaN ends for
    fewer than two)."""
    from scipy.special import stdtrit  # the t distribution's quantile (scipy.stats.t.ppf's), 0.1 s to import against scipy.stats's 0.5 s

    n = len(values)
    mean = sum(values) / n if n else math.nan
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stdtrit(n - 1, (1 + level) / 2) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_change(evals, arm: str, against: str, score: str, metric: str = "set_size", by: str = "stage") -> dict:
    """``arm``'s percent change of the mean ``metric`` against ``against`` (values of the column
    ``by``: the study's arms are stages, a sweep's methods are methods), per seed, then a t interval
    over the seeds that have both.  ``significant`` is false when the interval holds 0 or there is
    no interval (fewer than two seeds)."""
    part = evals[evals.score == score]
    per_seed = part.groupby(["seed", by])[metric].mean().unstack(by)
    change = 100 * (per_seed[arm] - per_seed[against]) / per_seed[against]
    change = change[change.map(math.isfinite)]  # a seed without one of them, or a zero reference
    mean, low, high = t_interval(change.tolist())
    return {"score": score, "arm": arm, "against": against, "seeds": len(change), "per_seed": [round(v, 2) for v in change],
            "mean": mean, "low": low, "high": high, "significant": bool(low > 0 or high < 0)}
