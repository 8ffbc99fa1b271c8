import hashlib
import os
import time
from pathlib import Path

import pytest

import suite_processes

# Ray on 2 cores is slow to start: one embedded instance serves each test process's session (one
# per pytest-xdist worker).
RAY_TEST_CPUS = 4  # logical CPUs: lets 2 Train workers and a Tune driver coexist on 2 cores


@pytest.fixture(scope="session")
def ray_session(pytestconfig):
    import ray

    from dpsm_ray.train.ray_session import start_embedded

    wait_for_the_cluster_tests(pytestconfig)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    start_embedded(num_cpus=RAY_TEST_CPUS, worker_output=False)
    yield
    ray.shutdown()


# `python -m pytest -q -m quick` (README): the conformal maths, objectives, models, data, config,
# training steps, method and dataset/model/score cards, search spaces, the predictor and the watchdog -- no Ray, about 25 s
# on 2 cores
QUICK = ("conformal/", "objectives/", "models/", "data/", "test_config.py", "train/test_step.py", "test_methods.py",
         "sweep/test_space.py", "test_predictor.py", "test_serving.py", "test_timing.py", "test_reaper.py", "test_cards.py")


def under_tests(path) -> str:
    """``path`` relative to tests/, with forward slashes: how QUICK and the lists below name files."""
    return os.path.relpath(str(path), os.path.dirname(__file__)).replace(os.sep, "/")


def pytest_ignore_collect(collection_path, config):
    """`-m quick` alone does not import the other test files (their imports -- Ray, Tune, Optuna,
    pandas -- took half of its collection): none of their tests has the marker."""
    if config.getoption("markexpr") != "quick" or collection_path.is_dir() or not collection_path.name.startswith("test_"):
        return None
    return True if not under_tests(collection_path).startswith(QUICK) else None


# The README's test command runs the suite on two pytest-xdist workers (pyproject.toml's addopts),
# which take whole work units in the order of the collection, each when it is nearly done with the
# last (pytest_xdist_make_scheduler): the `cluster` tests first, as one unit (they own the
# machine's Ray), beside them the Ray-free modules, then the modules that start Ray, longest first
# -- these, measured (docs/testing.md), then the rest in file order.  Every other unit is one
# module, so a module's fixtures (its shared sweep) are built once.
CLUSTER_MODULES = ("test_cluster_launcher.py", "test_gpu_autoscaling.py")
LONGEST_RAY_MODULES = ("sweep/test_resume.py", "sweep/test_sweep.py", "test_bench.py", "test_gpu_shaped.py", "test_fidelity.py", "sweep/test_group_sweep.py",
                       "test_predictor_sweep.py", "train/test_ray_session.py", "sweep/test_tools.py", "train/test_ray_train.py", "test_own_data_sweep.py",
                       "test_league_sweep.py")


def where(item) -> str:
    return under_tests(item.path)


def starts_ray(item) -> bool:
    return bool(item.get_closest_marker("ray")) or "ray_session" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    """Order the tests as above.  `ray up` and `ray down` run `ray stop`, which ends every Ray
    process of this user, and the fake autoscaler's head takes Ray's default head port:
    the `cluster` tests must be done before any other test starts or joins a Ray (without xdist
    they run first; with it, wait_for_the_cluster_tests holds the other worker).  The tests of
    QUICK's files get the `quick` marker, unless they start Ray."""
    ray_modules = {where(item) for item in items if starts_ray(item) or item.get_closest_marker("cluster")}
    misplaced = {where(item) for item in items if item.get_closest_marker("cluster") and where(item) not in CLUSTER_MODULES}
    assert not misplaced, f"cluster tests outside CLUSTER_MODULES (tests/conftest.py): {misplaced}"

    def rank(item) -> tuple:
        if where(item) in CLUSTER_MODULES:
            return (0,)
        if where(item) not in ray_modules:
            return (1,)
        longest = where(item) in LONGEST_RAY_MODULES
        return (2, LONGEST_RAY_MODULES.index(where(item)) if longest else len(LONGEST_RAY_MODULES))

    items.sort(key=rank)  # stable: file order within a rank
    for item in items:
        if where(item).startswith(QUICK) and not starts_ray(item) and not item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.quick)
        # a module with Ray tests may depend on the machine's Ray in its other tests too (whether a
        # cluster was started on it): it waits for the cluster tests as a whole
        item.stash[WAITS] = where(item) in ray_modules and where(item) not in CLUSTER_MODULES


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without it (-n 0 or not installed) never called
def pytest_xdist_make_scheduler(config, log):
    """With --dist loadscope (pyproject.toml): whole modules as work units, the cluster tests'
    modules as one (pytest-xdist's own loadgroup cannot be used: it renames the tests' nodeids,
    which pytest 9.2 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "loadscope":
        return None

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "cluster" if module.removeprefix("tests/") in CLUSTER_MODULES else module

    return ModuleScheduling(config, log)


def pytest_configure(config):
    """This run's token goes into the environment of every process it starts (the leak check,
    below).  Beside another pytest-xdist worker, this process and every process it starts (sweep
    drivers, Ray and its trials) compute with one thread: with two threads each, the two workers'
    torch work oversubscribes the 2 cores -- the ResNet-110 CLI test took 54 s instead of 23 s
    beside two busy processes (docs/testing.md)."""
    config.stash[RUN] = suite_processes.mark(worker=hasattr(config, "workerinput"))
    config.stash[SEEN] = suite_processes.Seen(config.stash[RUN])
    if getattr(config, "workerinput", {}).get("workercount", 1) > 1:
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(variable, "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# --- the cluster tests beside pytest-xdist's other worker ------------------------------------

WAITS = pytest.StashKey[bool]()
CLUSTER_TESTS = pytest.StashKey[set]()
CLUSTER_TESTS_WAIT_S = 3600


def cluster_done_folder(config) -> Path | None:
    """Where each cluster test, once done, leaves a file: in the run's temporary directory, which
    its xdist workers share (each has its own folder in it).  None without xdist, where the cluster
    tests run first in the one process."""
    if not hasattr(config, "workerinput"):  # what pytest-xdist gives its workers (a child process may inherit its environment)
        return None
    return Path(config.option.basetemp).parent / "cluster_tests_done"


def done_file(folder: Path, nodeid: str) -> Path:
    return folder / hashlib.sha256(nodeid.encode()).hexdigest()


def pytest_collection_finish(session):
    session.config.stash[CLUSTER_TESTS] = {item.nodeid for item in session.items if where(item) in CLUSTER_MODULES}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A cluster test, however it ended, says it is done; the processes of the run are noted."""
    try:
        return (yield)
    finally:
        item.config.stash[SEEN].note()
        folder = cluster_done_folder(item.config)
        if folder is not None and item.nodeid in item.config.stash[CLUSTER_TESTS]:
            folder.mkdir(exist_ok=True)
            done_file(folder, item.nodeid).touch()


def wait_for_the_cluster_tests(config) -> None:
    folder = cluster_done_folder(config)
    if folder is None:
        return
    deadline = time.monotonic() + CLUSTER_TESTS_WAIT_S
    while not all(done_file(folder, nodeid).exists() for nodeid in config.stash[CLUSTER_TESTS]):
        if time.monotonic() > deadline:
            pytest.fail(f"the cluster tests did not finish within {CLUSTER_TESTS_WAIT_S} s (nothing in {folder} says so)")
        time.sleep(1)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up
def pytest_runtest_setup(item):
    if item.get_closest_marker("cluster"):
        skip_beside_a_foreign_ray(item)
    if item.stash.get(WAITS, False):
        wait_for_the_cluster_tests(item.config)


def skip_beside_a_foreign_ray(item) -> None:
    """A `cluster` test owns the machine's Ray (its module's OWNS_THE_MACHINES_RAY says how):
    beside a Ray this run did not start it is skipped, and that Ray is left alone."""
    foreign = suite_processes.foreign_rays(item.config.stash[RUN])
    if foreign:
        pids: dict[str, list[str]] = {}
        for process in sorted(foreign, key=lambda p: p.pid):
            pids.setdefault(process.program, []).append(str(process.pid))
        shown = "; ".join(f"{program} pid {', '.join(numbers)}" for program, numbers in sorted(pids.items()))
        pytest.skip(f"a Ray this test run did not start is running on this machine ({shown}) and this test owns the machine's Ray"
                    f" ({item.module.OWNS_THE_MACHINES_RAY}): run it when no other Ray is running")


@pytest.fixture
def no_ray_start(monkeypatch):
    """Fails the test if the sweep driver tries to reach Ray: for checks that must happen before
    (whether this test session's Ray is up already does not matter)."""
    from dpsm_ray.sweep import driver

    def refuse(*args, **kwargs):
        raise AssertionError("the sweep went on to start (or join) Ray")

    monkeypatch.setattr(driver, "ensure_ray", refuse)


# --- the leak check: nothing the run started outlives it -------------------------------------
#
# Which processes are the run's: tests/suite_processes.py.  Each test process notes them after
# every test (an orphan re-parented later is still known by its pid and start time); a pytest-xdist
# worker hands its notes to the controller when it finishes.  At the end of the run -- after the
# workers have exited -- whatever the run started and is still running gets LEAK_WAIT_S to end on
# its own, then it is ended and the run fails, naming each process.

RUN = pytest.StashKey[str]()
SEEN = pytest.StashKey[suite_processes.Seen]()
LEFT = pytest.StashKey[list]()
LEAK_WAIT_S = 5  # an exited worker's watchdog ends its Ray's last processes within ~1 s
WORKER_NOTES = "dpsm_ray_test_processes"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook (the controller's): a worker has finished
def pytest_testnodedown(node, error):
    node.config.stash[SEEN].add_rows(getattr(node, "workeroutput", {}).get(WORKER_NOTES, []))


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which ends the workers
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        config.workeroutput[WORKER_NOTES] = config.stash[SEEN].rows()
        return
    left = suite_processes.left_running(config.stash[RUN], config.stash[SEEN], LEAK_WAIT_S)
    if left:
        suite_processes.end(left)
        config.stash[LEFT] = left
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = config.stash.get(LEFT, [])
    if left:
        terminalreporter.section("processes left running", red=True)
        terminalreporter.line(f"{len(left)} process(es) this test run started were still running {LEAK_WAIT_S} s after its end, and"
                              " were ended now: a test or fixture that starts a process must stop it in a `finally` or its teardown")
        for process in left:
            terminalreporter.line(f"  pid {process.pid}: {process.command[:300]}")
