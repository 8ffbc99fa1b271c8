"""Ray's private names the project uses (dpsm_ray/train/ray_private.py) are still where it looks:
a Ray upgrade that moves one fails here, by name, not in a user's sweep."""

import importlib
import re
from pathlib import Path

import pytest

from dpsm_ray.train import ray_private

PACKAGE = Path(__file__).resolve().parents[2] / "dpsm_ray"


@pytest.mark.parametrize("module, name", [("ray._private.services", "find_bootstrap_address"), ("ray._private.utils", "get_num_cpus")])
def test_each_private_name_is_still_there(module, name):
    assert callable(getattr(importlib.import_module(module), name, None)), f"Ray moved {module}.{name}: update dpsm_ray/train/ray_private.py"


def test_the_wrappers_answer_and_the_logger_is_ray_s():
    assert ray_private.ray_cpu_count() >= 1
    address = ray_private.bootstrap_address()
    assert address is None or isinstance(address, str)
    importlib.import_module(ray_private.AUTHENTICATION_LOGGER.rpartition(".")[0])  # its package exists


def test_no_other_module_of_the_package_reaches_into_ray_private():
    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if re.search(r"ray\._private", p.read_text()) and p.name != "ray_private.py"]
    assert users == []
