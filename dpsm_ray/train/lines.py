"""The training loop's per-epoch line, with its numbers attached."""

from __future__ import annotations


class EpochLine(str):
    """A training loop's per-epoch line that also carries its numbers, so that a caller showing
    one line in many (the sweep, for the base model) can write its own."""

    def __new__(cls, text: str, *, epoch: int, epochs: int, seconds: float, val_set_size: float, method: str):
        line = super().__new__(cls, text)
        line.epoch, line.epochs, line.seconds, line.val_set_size, line.method = epoch, epochs, seconds, val_set_size, method
        return line
