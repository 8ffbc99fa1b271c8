"""The miscoverage level alpha and what it asks of a calibration set, without torch (the command
line checks them before torch loads)."""

from __future__ import annotations

import math
from fractions import Fraction


def check_alpha(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in the open interval (0, 1); got {alpha}")
    return alpha


def min_calibration_size(alpha: float) -> int:
    """The fewest calibration points whose conformal quantile is finite: the smallest n with
    ceil((n + 1)(1 - alpha)) <= n, i.e. n >= (1 - alpha) / alpha (exact, as ``conformal_rank``).
    With fewer, q_hat is +inf and every prediction set holds every label."""
    check_alpha(alpha)
    a = Fraction(repr(float(alpha)))
    return math.ceil((1 - a) / a)
