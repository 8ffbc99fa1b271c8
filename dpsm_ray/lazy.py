"""Imports put off until first use, so the command line checks its options before torch and Ray
load: a package's face hands on the names of its modules (PEP 562), and a card names its code as
``"module:name"`` (the form of Python's entry points).

    HANDED_ON = {"Predictor": "predict.predictor"}  # each name -> the module under the package that defines it
    __getattr__ = handed_on(__name__, HANDED_ON)
    imported("dpsm_ray.objectives.ce:CrossEntropy")  # the class, imported now
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def handed_on(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package`` that imports each name of ``where`` from
    ``package.<where[name]>`` when it is first asked for."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return imported(f"{package}.{where[name]}:{name}")

    return __getattr__


def imported(reference: str):
    """The object that ``reference``, ``"module:name"``, names (importing its module)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
