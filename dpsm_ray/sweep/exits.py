"""The one exit-code ladder of every command that trains: ``dpsm-ray train``, ``dpsm-ray sweep`` and
the sweep scripts, the studies.

    0  it finished (or had finished before: what it made is shown again)
    2  bad input -- an option, a file, a directory, resources the cluster can never give -- in one
       line naming it, before anything is trained where it can be known then
    3  it stopped before the end (Ctrl-C wherever it lands, a full disk, a lost cluster): the same
       command continues it (``--resume`` for a sweep or study)

A command wraps its work in ``exit_codes(parser, ...)``; whatever is raised inside maps to one line
on stderr and its status.  A finished sweep asked again (``SweepFinished``) is the caller's to show.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

_RESUME = "rerun with --resume to continue"


@contextmanager
def exit_codes(parser: argparse.ArgumentParser, *, again: str = _RESUME, where=None, flag=None):
    """Map what the block raises to one line and an exit status (module docstring).  ``again``:
    how to continue after a stop; ``where()``: the directory whose device a full disk names (None:
    none); ``flag(field)``: the option that sets a config field (default ``--field-name``)."""
    from dpsm_ray.config import ConfigError
    from dpsm_ray.files import CorruptFileError, is_disk_full
    from dpsm_ray.sweep.spec import ResultsDirUnusable, SweepError, SweepFinished
    from dpsm_ray.train.ray_session import InsufficientResources

    prog = parser.prog
    try:
        yield
    except SweepFinished:
        raise
    except ConfigError as error:
        option = flag(error.field) if flag is not None else "--" + error.field.replace("_", "-")
        parser.exit(2, f"{prog}: error: {option}={error.value!r} is invalid: {error.allowed}\n")
    except ResultsDirUnusable as error:  # a SweepError, but bad input: 3 would say "--resume continues"
        parser.exit(2, f"{prog}: error: {error}\n")
    except SweepError as error:
        parser.exit(3, f"{prog}: {error}\n")
    except (InsufficientResources, ConnectionError, CorruptFileError, FileNotFoundError) as error:
        parser.exit(2, f"{prog}: error: {error}\n")
    except KeyboardInterrupt:
        parser.exit(3, f"{prog}: interrupted; {again}\n")
    except Exception as error:
        if not is_disk_full(error):
            raise
        from dpsm_ray.files import free_space
        from dpsm_ray.sweep.stage import disk_full_line

        place = where() if where is not None else None
        place = f" ({free_space(place)} free where {place} is)" if place is not None else ""
        parser.exit(3, f"{prog}: {disk_full_line(error)}{place}; free some space and {again}\n")
