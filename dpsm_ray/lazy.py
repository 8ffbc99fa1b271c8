"""How a package's face hands on the names of its modules as they are first used (PEP 562): the
face imports nothing heavy, so the command line checks its options before torch and Ray load.

    HANDED_ON = {"Predictor": "predict.predictor"}  # each name -> the module under the package that defines it
    __getattr__ = handed_on(__name__, HANDED_ON)
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
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
