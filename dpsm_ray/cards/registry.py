"""What every axis's cards share: a registry per axis, which cards ship with the package, and the
cards registered from outside it (a sweep sends those to its trials)."""

from __future__ import annotations

REGISTRIES: dict[str, dict] = {}  # axis -> {name: card}; models first: a dataset card names its default model
_BUILT_IN: set[tuple[str, str]] = set()  # (axis, name) of the cards the package registers
_SEALED: set[str] = set()  # the axes whose built-in cards are all registered


def registry(kind: str) -> dict:
    return REGISTRIES.setdefault(kind, {})


def register(kind: str, card, replace: bool):
    """Put ``card`` into the ``kind`` registry; while the package registers its own (until ``seal``),
    the card is built in."""
    if not card.name.isidentifier():
        raise ValueError(f"{kind} name must be an identifier (letters, digits, _); got {card.name!r}")
    if (kind, card.name) in _BUILT_IN and kind in _SEALED:
        raise ValueError(f"{kind} {card.name!r} is built in")
    cards = registry(kind)
    if card.name in cards and not replace and cards[card.name] != card:
        raise ValueError(f"{kind} {card.name!r} is registered already (pass replace=True to change it)")
    cards[card.name] = card
    if kind not in _SEALED:
        _BUILT_IN.add((kind, card.name))
    return card


def seal(kind: str) -> None:
    """The package's own ``kind`` cards are registered: later ones come from outside it."""
    _SEALED.add(kind)


def sealed() -> frozenset[str]:
    return frozenset(_SEALED)


def built_in(kind: str, name: str) -> bool:
    """Whether the ``kind`` card ``name`` ships with the package."""
    return (kind, name) in _BUILT_IN


def unregister(kind: str, name: str) -> None:
    """Forget the ``kind`` card ``name`` registered from outside the package."""
    if built_in(kind, name):
        raise ValueError(f"{kind} {name!r} is built in")
    registry(kind).pop(name, None)


def outside_cards() -> tuple:
    """Every card registered from outside the package, of every axis."""
    return tuple(card for kind, cards in REGISTRIES.items() for name, card in cards.items() if not built_in(kind, name))
