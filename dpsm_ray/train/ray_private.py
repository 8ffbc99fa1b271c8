"""Every use of Ray's private modules (``ray._private``), in one place.

Ray has no public API for these three things; a Ray upgrade may move them, and
tests/train/test_ray_private.py then fails by name rather than a sweep failing later.
"""

from __future__ import annotations

# The logger of Ray's token-authentication setup, which warns on every embedded start.
AUTHENTICATION_LOGGER = "ray._private.authentication.authentication_token_setup"


def bootstrap_address() -> str | None:
    """The address a plain ``ray.init()`` would join: a cluster started on this machine with
    ``ray start`` (recorded in Ray's temp directory; ``ray stop`` removes it), or None."""
    from ray._private.services import find_bootstrap_address

    return find_bootstrap_address(None)


def ray_cpu_count() -> int:
    """This machine's CPUs as ``ray.init`` counts them (cgroup quotas included)."""
    from ray._private.utils import get_num_cpus

    return get_num_cpus()
