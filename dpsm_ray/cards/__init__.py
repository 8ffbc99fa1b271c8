"""The cards: one record per method, dataset, model and score -- what each is, and the one place
every list of them reads (config validation, the CLI's choices and ``--help``, the sweep's search
and GPU packing, the report's order, names and colours, the predictor, ``evaluate``).

    methods.py   MethodCard, register_method: the training objectives (dpsm_ray/objectives/)
    knobs.py     the knobs a search varies, their default ranges, the paper's grid
    datasets.py  DatasetCard, register_dataset; load_splits
    models.py    ModelCard, register_model; build_model
    scores.py    ScoreCard, register_score; score_matrix
    registry.py  what the four share: built-in or registered from outside, and the outside ones

A card of the package reaches its code through ``dpsm_ray.lazy.imported`` (a ``"module:name"``, or
a small function that imports it where the card adapts arguments), only when a run needs it (as
Ray's search-algorithm table): the cards import neither torch nor Ray, so
the command line answers ``--help`` and checks its options before either loads.  A card defined
outside the package joins through its axis's ``register_*`` (docs/extending.md), and a sweep
sends those cards to its trials.
"""

from dpsm_ray.cards.knobs import (
    DEFAULT_RANGES,
    KNOB_ALIASES,
    PAPER_GRID,
    SHARED_GRID_AXES,
    Range,
    knob_name,
    with_current_knob_names,
)
from dpsm_ray.cards.methods import (
    BASE_MODEL,
    BUILT_IN as BUILT_IN_METHODS,
    REFERENCE_METHOD,
    METHODS,
    PAPER_METHODS,
    MethodCard,
    MethodOption,
    build_objective,
    headline_method,
    method_card,
    method_cards,
    method_fields,
    method_names,
    method_options,
    paper_grid,
    preset_settings,
    reads,
    register_method,
    unregister_method,
)
from dpsm_ray.cards.models import (
    ModelCard,
    build_model,
    check_model,
    check_outputs,
    import_factory,
    is_factory,
    model_card,
    model_cards,
    model_choices,
    model_names,
    pretrainable_models,
    register_model,
)
from dpsm_ray.cards.datasets import (
    DatasetCard,
    check_data_present,
    check_dataset,
    data_change,
    data_record,
    dataset_card,
    dataset_names,
    default_model,
    load_splits,
    pretrained_problem,
    register_dataset,
    split_sizes,
)
from dpsm_ray.cards.scores import (
    ScoreCard, check_score, paper_score_names, register_score, score_card, score_functions, score_matrix, score_names,
)
from dpsm_ray.cards.registry import built_in, outside_cards, unregister


def register_cards(outside) -> None:
    """Register cards of any axis, each replacing one of its name: what a process of a sweep's
    (a trial, a base model's or a predictor's Ray task) does with the cards its driver registered
    outside the package (``outside_cards``)."""
    for card in outside:
        for kind, register in (
            (MethodCard, register_method),
            (DatasetCard, register_dataset),
            (ModelCard, register_model),
            (ScoreCard, register_score),
        ):
            if isinstance(card, kind):
                register(card, replace=True)
                break
        else:
            raise TypeError(f"not a card: {card!r}")


__all__ = [
    "BASE_MODEL",
    "BUILT_IN_METHODS",
    "DEFAULT_RANGES",
    "DatasetCard",
    "KNOB_ALIASES",
    "METHODS",
    "MethodCard",
    "MethodOption",
    "ModelCard",
    "PAPER_GRID",
    "PAPER_METHODS",
    "Range",
    "SHARED_GRID_AXES",
    "ScoreCard",
    "build_model",
    "build_objective",
    "built_in",
    "check_data_present",
    "check_dataset",
    "data_change",
    "data_record",
    "check_model",
    "check_outputs",
    "check_score",
    "dataset_card",
    "dataset_names",
    "default_model",
    "import_factory",
    "is_factory",
    "knob_name",
    "load_splits",
    "method_card",
    "method_cards",
    "method_fields",
    "method_names",
    "method_options",
    "model_card",
    "model_cards",
    "model_choices",
    "model_names",
    "outside_cards",
    "paper_grid",
    "paper_score_names",
    "pretrainable_models",
    "pretrained_problem",
    "reads",
    "register_cards",
    "register_dataset",
    "register_method",
    "register_model",
    "register_score",
    "score_card",
    "score_functions",
    "score_matrix",
    "score_names",
    "split_sizes",
    "unregister",
    "unregister_method",
    "with_current_knob_names",
]
