"""dpsm_ray: conformal classifier training (DPSM, ConfTr, CUT, CE) and hyperparameter sweeps on Ray.

``from dpsm_ray import Predictor`` loads a trained conformal classifier without importing Ray
(``dpsm_ray.predict.predictor``); the package imports its parts only when they are used.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Predictor":
        from dpsm_ray.predict.predictor import Predictor

        return Predictor
    raise AttributeError(f"module 'dpsm_ray' has no attribute {name!r}")


__all__ = ["Predictor", "__version__"]
