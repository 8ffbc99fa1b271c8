"""The sweep driver's parts import one way: each module imports alone, in a fresh interpreter,
whatever was imported before it (an import circle fails here with a partly initialised module)."""

import subprocess
import sys

import pytest

MODULES = ("dpsm_ray.cards", "dpsm_ray.cards.methods", "dpsm_ray.cards.datasets", "dpsm_ray.cards.scores", "dpsm_ray.conformal.levels",
           "dpsm_ray.sweep.space", "dpsm_ray.sweep.spec", "dpsm_ray.sweep.pick", "dpsm_ray.sweep.collect",
           "dpsm_ray.sweep.stage", "dpsm_ray.sweep.driver", "dpsm_ray.results.report")


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=120)
