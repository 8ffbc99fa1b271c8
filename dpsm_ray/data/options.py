"""Options of the generated datasets, written into their names: ``synthetic:classes=20,noise=1.5``."""

from __future__ import annotations

import math


def dataset_options(spec: str, defaults: dict[str, float], floats: tuple[str, ...] = ("noise",)) -> dict[str, float]:
    """``family`` or ``family:key=value,...`` -> ``defaults`` updated by the named options; the
    keys in ``floats`` are read as floats, the others as integers.  Range checks are the caller's."""
    family, _, rest = spec.partition(":")
    options = dict(defaults)
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"dataset: unknown {family} option {key!r}; allowed: {', '.join(defaults)}")
        try:
            options[key] = float(value) if key in floats else int(value)
        except ValueError:
            raise ValueError(f"dataset: {family} option {key} must be a number; got {value!r}") from None
        if not math.isfinite(options[key]):
            raise ValueError(f"dataset: {family} option {key} must be a finite number; got {value!r}")
    return options
