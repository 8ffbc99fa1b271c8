"""dpsm_ray: conformal classifier training (DPSM, ConfTr, CUT, CE) and hyperparameter sweeps on Ray.

``from dpsm_ray import Predictor`` loads a trained conformal classifier without importing Ray
(``dpsm_ray.predict.predictor``); the package imports its parts only when they are used.  A package's
face hands on its modules' names as they are first used (PEP 562), from a table of where each lives
-- here, and in ``dpsm_ray.conformal``.
"""

from __future__ import annotations

from dpsm_ray.lazy import handed_on

__version__ = "0.1.0"
HANDED_ON = {"Predictor": "predict.predictor"}  # where each name lives under dpsm_ray/


__getattr__ = handed_on(__name__, HANDED_ON)


__all__ = ["Predictor", "__version__"]
