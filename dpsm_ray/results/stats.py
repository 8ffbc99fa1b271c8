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

    n, mean, sd = len(values), *_mean_sd(values)
    if n < 2:
        return mean, math.nan, math.nan
    half = stdtrit(n - 1, (1 + level) / 2) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1) of ``values``; NaN where undefined."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n >= 2 else math.nan
    return mean, sd


POWER = 0.8


def detectable_effect(values: list[float], level: float = T_LEVEL, power: float = POWER) -> float:
    """The smallest true mean a two-sided paired t test at ``level`` detects with probability
    ``power`` from as many replicates as ``values``, at their SD: (t(1 - (1 - level) / 2, n - 1) +
    t(power, n - 1)) * SD / sqrt(n) (the usual normal-shift approximation; NaN for fewer than two)."""
    from scipy.special import stdtrit

    n, (_, sd) = len(values), _mean_sd(values)
    if n < 2:
        return math.nan
    return (stdtrit(n - 1, (1 + level) / 2) + stdtrit(n - 1, power)) * sd / math.sqrt(n)


def per_seed_change(evals, arm: str, against: str, score: str, metric: str = "set_size", by: str = "stage"):
    """The percent change of ``arm``'s mean ``metric`` against ``against``'s, per seed (a pandas
    Series indexed by seed; seeds without both, or with a zero reference, left out)."""
    part = evals[evals.score == score]
    per_seed = part.groupby(["seed", by])[metric].mean().unstack(by)
    change = 100 * (per_seed[arm] - per_seed[against]) / per_seed[against]
    return change[change.map(math.isfinite)]


def summary(values: list[float]) -> dict:
    """Mean, t interval, significance and detectable effect of per-seed values."""
    mean, low, high = t_interval(values)
    return {
        "seeds": len(values),
        "mean": mean,
        "low": low,
        "high": high,
        "significant": bool(low > 0 or high < 0),
        "detectable": detectable_effect(values),
    }


def paired_change(evals, arm: str, against: str, score: str, metric: str = "set_size", by: str = "stage") -> dict:
    """``arm``'s percent change of the mean ``metric`` against ``against`` (values of the column
    ``by``: the study's arms are stages, a sweep's methods are methods), per seed, then a t interval
    over the seeds that have both, and the smallest change those seeds detect with 80% power
    (``detectable``).  ``significant`` is false when the interval holds 0 or there is no interval
    (fewer than two seeds)."""
    change = per_seed_change(evals, arm, against, score, metric, by)
    return {"score": score, "arm": arm, "against": against, "per_seed": [round(v, 2) for v in change], **summary(change.tolist())}


def unpaired_change(values: list[float], reference: list[float], level: float = T_LEVEL) -> dict:
    """The percent change of mean(``values``) against mean(``reference``) where the two share no
    replicate (seeds fine-tuned from different base models): on the log of the ratio of the means,
    the delta method's variance s1^2 / (n1 m1^2) + s2^2 / (n2 m2^2), a Student t interval with
    Welch-Satterthwaite's degrees of freedom, both ends mapped back to percent.  NaN ends for fewer
    than two of either."""
    from scipy.special import stdtrit

    (m1, s1), (m2, s2), n1, n2 = _mean_sd(values), _mean_sd(reference), len(values), len(reference)
    mean = 100 * (m1 / m2 - 1)
    if n1 < 2 or n2 < 2:
        return {"mean": mean, "low": math.nan, "high": math.nan}
    v1, v2 = s1**2 / (n1 * m1**2), s2**2 / (n2 * m2**2)
    df = (v1 + v2) ** 2 / (v1**2 / (n1 - 1) + v2**2 / (n2 - 1)) if v1 + v2 > 0 else math.inf
    half = stdtrit(df, (1 + level) / 2) * math.sqrt(v1 + v2) if math.isfinite(df) else 0.0
    ratio = math.log(m1 / m2)
    return {"mean": mean, "low": 100 * (math.exp(ratio - half) - 1), "high": 100 * (math.exp(ratio + half) - 1)}
