import os

import pytest

# Ray on 2 cores is slow to start: one embedded instance serves the whole test session.
RAY_TEST_CPUS = 4  # logical CPUs: lets 2 Train workers and a Tune driver coexist on 2 cores


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    from dpsm_ray.train.ray_train import embedded_ray_settings

    embedded_ray_settings()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=RAY_TEST_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
