"""dpsm_ray: conformal classifier training (DPSM, ConfTr, CUT, CE) and hyperparameter sweeps on Ray."""

__version__ = "0.1.0"
