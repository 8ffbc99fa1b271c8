import os

import pytest

# Ray on 2 cores is slow to start: one embedded instance serves the whole test session.
RAY_TEST_CPUS = 4  # logical CPUs: lets 2 Train workers and a Tune driver coexist on 2 cores


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    from dpsm_ray.train.ray_session import start_embedded

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    start_embedded(num_cpus=RAY_TEST_CPUS, worker_output=False)
    yield
    ray.shutdown()


# `python -m pytest -q -m quick` (README): the conformal maths, objectives, models, data, config,
# training steps, method cards, search spaces and the predictor -- no Ray, about 30 s on 2 cores
QUICK = ("conformal/", "objectives/", "models/", "data/", "train/test_config.py", "train/test_step.py", "test_methods.py",
         "sweep/test_space.py", "test_predictor.py", "test_timing.py")


def pytest_collection_modifyitems(config, items):
    """The `cluster` tests first: `ray up` and `ray down` run `ray stop`, which ends every Ray
    process of this user, so they must be done before any other test starts the session's Ray.
    The tests of QUICK's files get the `quick` marker, unless they start Ray."""
    items.sort(key=lambda item: item.get_closest_marker("cluster") is None)
    root = os.path.dirname(__file__)
    for item in items:
        where = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if where.startswith(QUICK) and not item.get_closest_marker("ray") and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def no_ray_start(monkeypatch):
    """Fails the test if the sweep driver tries to reach Ray: for checks that must happen before
    (whether this test session's Ray is up already does not matter)."""
    from dpsm_ray.sweep import protocol

    def refuse(*args, **kwargs):
        raise AssertionError("the sweep went on to start (or join) Ray")

    monkeypatch.setattr(protocol, "ensure_ray", refuse)
