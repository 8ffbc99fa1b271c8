"""One card per non-conformity score: its matrix S(x, y) for every label, whether it is randomised,
its own hyperparameters.  A score of the researcher's own joins through ``register_score``
(docs/extending.md).

Known without importing torch: a built-in card reaches its code in ``dpsm_ray.conformal.scores``
by name (``_matrix``, through ``dpsm_ray.lazy.imported``) or through a small function importing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dpsm_ray.cards.registry import register, registry, seal
from dpsm_ray.lazy import imported


@dataclass(frozen=True)
class ScoreCard:
    """A non-conformity score S(x, y), smaller meaning more conforming: ``matrix(probs, u,
    **parameters)`` maps probabilities ``[n, K]`` and one uniform per example ``[n]`` (None: no
    randomisation) to the scores of every label ``[n, K]``.  ``randomised``: its sets depend on
    the uniforms (a predictor records it); ``parameters``: its own hyperparameters with their
    defaults (RAPS's ``lambda`` and ``k_reg``), recorded in every predictor calibrated with it;
    ``paper``: one of the DPSM paper's three (HPS, APS, RAPS), the evaluation's default -- the others
    are evaluated when ``--eval-scores`` names them, and every predictor calibrates them all."""

    name: str
    title: str
    matrix: Callable[..., Any]
    randomised: bool = False
    parameters: Mapping[str, float] = field(default_factory=dict)
    paper: bool = False


_SCORES = registry("score")  # in the report's order


def register_score(card: ScoreCard, *, replace: bool = False) -> ScoreCard:
    """Make ``card``'s score known to evaluation, reports, predictors and the CLI in this process."""
    return register("score", card, replace)


def score_names() -> tuple[str, ...]:
    """Every score, in the report's order."""
    return tuple(_SCORES)


def paper_score_names() -> tuple[str, ...]:
    """The paper's scores (HPS, APS, RAPS), in the report's order: what a run evaluates unless
    ``--eval-scores`` says otherwise, so that adding a score changes no run's configuration hash."""
    return tuple(name for name, card in _SCORES.items() if card.paper)


def score_card(name: str) -> ScoreCard:
    if name not in _SCORES:
        raise ValueError(f"score must be one of {', '.join(_SCORES)}; got {name!r}")
    return _SCORES[name]


def check_score(name: str) -> str:
    score_card(name)
    return name


def score_matrix(probs, kind: str, *, u=None, parameters: Mapping[str, float] | None = None):
    """Scores of every label, ``[n, K]``, by the score card ``kind``; smaller means more
    conforming.  ``u`` is one uniform per example (shape ``[n]``) for the randomised scores, shared
    by all labels of that example so that APS/RAPS sets stay prefixes of the sorted labels;
    ``None`` means U = 1 (not randomised).  ``parameters`` override the card's own
    hyperparameters (RAPS's ``lambda`` and ``k_reg``)."""
    card = score_card(kind)
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape [n, K]; got {tuple(probs.shape)}")
    unknown = sorted(set(parameters or {}) - set(card.parameters))
    if unknown:
        raise ValueError(f"score {kind} has no parameter {', '.join(unknown)}; it has {', '.join(card.parameters) or 'none'}")
    return card.matrix(probs, u, **{**card.parameters, **(parameters or {})})


def score_functions(names=None, parameters: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Callable]:
    """``{name: matrix(probs, u)}`` for the scores ``names`` (default: every score), each with its
    card's parameters, overridden by ``parameters[name]``: what ``dpsm_ray.conformal.evaluate`` (dpsm_ray/conformal/evaluation.py)
    takes."""
    names = score_names() if names is None else tuple(names)
    for name in names:
        check_score(name)

    def bound(name: str) -> Callable:
        given = (parameters or {}).get(name)
        return lambda probs, u=None: score_matrix(probs, name, u=u, parameters=given)

    return {name: bound(name) for name in names}


# -- the built-in scores ---------------------------------------------------------------------------
def _matrix(name: str, *, uniforms: bool):
    """``dpsm_ray.conformal.scores``' ``name`` (imported when a score is computed: the cards must not
    import torch), given the uniforms where the score is randomised."""

    def matrix(probs, u=None):
        function = imported(f"dpsm_ray.conformal.scores:{name}")
        return function(probs, u) if uniforms else function(probs)

    return matrix


def _raps(probs, u=None, *, k_reg, **parameters):
    from dpsm_ray.conformal.scores import aps_matrix

    return aps_matrix(probs, u, penalty=parameters["lambda"], k_reg=k_reg)


def _saps(probs, u=None, **parameters):
    from dpsm_ray.conformal.scores import saps_matrix

    return saps_matrix(probs, u, weight=parameters["lambda"])


for _card in (
    ScoreCard("hps", "HPS (THR, LAC): 1 - p_y", _matrix("hps_matrix", uniforms=False), paper=True),
    ScoreCard("aps", "APS: the mass ranked above y plus U p_y", _matrix("aps_matrix", uniforms=True), randomised=True, paper=True),
    ScoreCard("raps", "RAPS: APS plus lambda max(0, rank(y) - k_reg)", _raps, randomised=True, parameters={"lambda": 0.01, "k_reg": 5},
              paper=True),
    ScoreCard("saps", "SAPS: U p_max for the top label, p_max + (rank(y) - 2 + U) lambda below it", _saps, randomised=True,
              parameters={"lambda": 0.2}),
    ScoreCard("topk", "top-k: rank(y) - 1 + U", _matrix("topk_matrix", uniforms=True), randomised=True),
    ScoreCard("margin", "margin: the largest other probability minus p_y", _matrix("margin_matrix", uniforms=False)),
):
    register_score(_card)
seal("score")
