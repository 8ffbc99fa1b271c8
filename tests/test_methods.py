"""The method cards: the tables they replace, registration from outside the package, and the
objective's interface the training loop asks instead of its class."""

import subprocess
import sys

import pytest
import torch

from dpsm_ray.cards import BUILT_IN_METHODS as BUILT_IN, KNOB_ALIASES, MethodCard, method_card, method_fields, method_names, reads, register_method, unregister_method
from dpsm_ray.cards import build_objective
from dpsm_ray.objectives import DPSM, ConfTr, CrossEntropy
from dpsm_ray.objectives.base import Objective
from dpsm_ray.cards import paper_grid
from dpsm_ray.sweep.space import method_knobs
from dpsm_ray.config import TrainConfig, validate

# The tables the cards replaced (train/config.py METHOD_FIELDS, sweep/space.py METHOD_KNOBS and
# GRID_METHOD_AXES before issue 22), written out once more: the cards must say the same.
OLD_METHOD_FIELDS = {
    "conformal_weight": ("conftr", "conftr_published", "cut", "dpsm"), "sigmoid_temperature": ("conftr", "conftr_published", "dpsm"),
    "sort_temperature": ("conftr", "conftr_published", "cut"), "quantile_lr": ("dpsm",), "q_init": ("dpsm",), "dpsm_split": ("dpsm",),
    "conftr_split": ("conftr",), "cut_score": ("cut",), "ce_batch": ("cut", "dpsm"), "size_target": ("conftr_published",), "ce_weight": ("conftr_published",),
}
OLD_KNOBS = {"ce": ("lr",), "cut": ("lambda", "lr"), "conftr": ("lambda", "lr", "temperature"), "conftr_published": ("lr", "temperature"),
             "dpsm": ("lambda", "lr", "gamma", "temperature")}
SHARED = ("batch_size", "epochs", "lr", "milestones", "lr_decay")
OLD_GRID = {"ce": SHARED, "cut": (*SHARED, "lambda"), "conftr": (*SHARED, "lambda"), "conftr_published": SHARED, "dpsm": (*SHARED, "lambda", "gamma")}


# The methods added since (docs/baselines.md), not in the paper's table: what each reads and searches.
NEW_METHOD_FIELDS = {"confts": (), "vr_conftr": ("conformal_weight", "sigmoid_temperature", "vr_neighbours"), "rwce": ("rank_exponent",)}
NEW_KNOBS = {"confts": ("lr",), "vr_conftr": ("conformal_weight", "lr", "sigmoid_temperature"), "rwce": ("lr",)}
NEW_GRID = {"confts": SHARED, "vr_conftr": (*SHARED, "conformal_weight"), "rwce": SHARED}
NEW_OPTIONS = (("vr_neighbours", 6, "vr_conftr"), ("rank_exponent", 2.0, "rwce"))  # an option only that method reads, another value


def test_the_cards_say_what_the_old_tables_said():
    assert set(BUILT_IN) == set(OLD_KNOBS) | set(NEW_KNOBS)
    new_fields = {field for fields in NEW_METHOD_FIELDS.values() for field in fields} - set(OLD_METHOD_FIELDS)
    assert method_fields() == set(OLD_METHOD_FIELDS) | new_fields
    for name in (*OLD_KNOBS, "base"):
        for field, methods in OLD_METHOD_FIELDS.items():
            assert reads(name, field) == (name in methods), (name, field)
        assert not any(reads(name, field) for field in new_fields), name
    for name, fields in NEW_METHOD_FIELDS.items():
        assert {field for field in method_fields() if reads(name, field)} == set(fields), name
    for name in (*BUILT_IN, "base"):
        assert reads(name, "lr") and reads(name, "alpha")
    # the knobs were renamed since (KNOB_ALIASES: lambda -> conformal_weight, ...): the same knobs
    assert {m: method_knobs(m) for m in OLD_KNOBS} == {m: tuple(KNOB_ALIASES.get(k, k) for k in knobs) for m, knobs in OLD_KNOBS.items()}
    assert {m: BUILT_IN[m].grid_axes for m in OLD_GRID} == {m: tuple(KNOB_ALIASES.get(a, a) for a in axes) for m, axes in OLD_GRID.items()}
    assert {m: method_knobs(m) for m in NEW_KNOBS} == NEW_KNOBS and {m: BUILT_IN[m].grid_axes for m in NEW_GRID} == NEW_GRID


def test_the_methods_added_since_the_paper_are_offered_but_not_run_by_default():
    from dpsm_ray.cards import METHODS, PAPER_METHODS

    assert PAPER_METHODS == ("ce", "conftr", "cut", "dpsm")  # the paper's table: a sweep's default --methods
    assert set(NEW_KNOBS) <= set(METHODS) and not set(NEW_KNOBS) & set(PAPER_METHODS)
    assert [card.name for card in BUILT_IN.values()][-len(NEW_KNOBS):] == list(NEW_KNOBS)  # after DPSM in the report


@pytest.mark.parametrize("changes,field", [({"vr_neighbours": 0}, "vr_neighbours"), ({"vr_neighbours": 2.5}, "vr_neighbours"),
                                           ({"rank_exponent": -0.5}, "rank_exponent")])
def test_the_new_methods_options_are_checked(changes, field):
    from dpsm_ray.config import ConfigError

    with pytest.raises(ConfigError) as error:
        TrainConfig(**changes)
    assert error.value.field == field and repr(changes[field]) in str(error.value)


def test_the_new_methods_options_change_only_their_own_method_s_hash():
    for option, value, method in NEW_OPTIONS:
        for other in BUILT_IN:
            changed = TrainConfig(method=other, **{option: value}).config_hash() != TrainConfig(method=other).config_hash()
            assert changed == (other == method), (option, other)


def test_the_cards_load_without_torch_or_ray():
    code = "import sys, dpsm_ray.cards, dpsm_ray.facts, dpsm_ray.conformal.levels; assert not {'torch', 'ray'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_loop_asks_the_objective_what_it_learns():
    common = dict(alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, sort_temperature=0.0, quantile_lr=0.05)
    dpsm, conftr, ce = (build_objective(m, **common) for m in ("dpsm", "conftr", "ce"))
    assert (type(dpsm), type(conftr), type(ce)) == (DPSM, ConfTr, CrossEntropy)
    assert dpsm.uses_quantile and conftr.uses_quantile and not ce.uses_quantile
    scores = torch.linspace(0, 1, 101, dtype=torch.float64)
    dpsm.initialize(scores)
    assert dpsm.learned_quantile() == pytest.approx(float(dpsm.q)) and ce.learned_quantile() is None
    assert dpsm.quantile_lr == 0.05 and ce.quantile_lr != ce.quantile_lr  # NaN
    assert dpsm.start_line(scores).startswith("q_0 ")
    assert ce.training_quantiles(scores, scores, 10, torch.Generator(), 100) is None
    every = conftr.training_quantiles(scores, scores, 10, torch.Generator().manual_seed(0), 100)
    assert every.shape == (20,)  # 101 scores in batches of 5: all 20 whole batches
    # at most `batches` of them: the first of the same random order, so a sample of the 20
    assert torch.equal(conftr.training_quantiles(scores, scores, 10, torch.Generator().manual_seed(0), 7), every[:7])
    with pytest.raises(TypeError, match="no method reads"):
        build_objective("dpsm", **common, quantile_rate=0.1)


class HalfWeight(Objective):
    """A stand-in for a researcher's method: CE plus lambda times the mean top-class score."""

    def __call__(self, logits1, labels1, logits2, labels2):
        logits = torch.cat([logits1, logits2])
        ce = torch.nn.functional.cross_entropy(logits, torch.cat([labels1, labels2]))
        return self.output(ce, logits.softmax(dim=1).amax(dim=1).mean())


@pytest.fixture
def outside_method():
    card = register_method(MethodCard("half_weight", "Half weight", HalfWeight, fields=("conformal_weight",), knobs=("conformal_weight", "lr")))
    yield card
    unregister_method(card.name)


def test_an_outside_method_joins_validation_hashing_the_search_space_and_the_objectives(outside_method):
    assert "half_weight" in method_names() and method_card("half_weight") is outside_method
    config = TrainConfig(method="half_weight", conformal_weight=0.3)
    validate(config)
    assert config.config_hash() != config.replace(conformal_weight=0.4).config_hash()
    assert config.config_hash() == config.replace(quantile_lr=0.5).config_hash()  # not its field
    assert method_knobs("half_weight") == ("conformal_weight", "lr") and tuple(paper_grid("half_weight")) == SHARED
    objective = build_objective("half_weight", alpha=0.1, conformal_weight=0.3, quantile_lr=0.1)
    assert isinstance(objective, HalfWeight) and objective.conformal_weight == 0.3


def test_registration_refuses_a_field_every_method_reads_and_a_second_card_of_one_name(outside_method):
    with pytest.raises(ValueError, match="method-specific"):
        register_method(MethodCard("lr_only", "LR", HalfWeight, fields=("lr",)))
    with pytest.raises(ValueError, match="knobs must be among"):
        register_method(MethodCard("typo", "Typo", HalfWeight, knobs=("lamda",)))
    with pytest.raises(ValueError, match="registered already"):
        register_method(MethodCard("half_weight", "Other", HalfWeight))
    with pytest.raises(ValueError, match="built in"):
        unregister_method("dpsm")
