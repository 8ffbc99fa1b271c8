"""A database password given to a sweep is never printed and never written anywhere (issue 21,
item 6): against a real PostgreSQL server this test starts on 127.0.0.1 (Debian's postgresql
package; .ci/run installs it) and stops afterwards.  The sweep gets the URL from
DPSM_RAY_OPTUNA_STORAGE, as a user keeps it out of their shell history."""

import glob
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-Pw-4711"
SERVER = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
SWEEP = ["--methods", "ce", "--trials", "1", "--final-seeds", "1", "--base-epochs", "1", "--epochs", "1", "--workers", "0", "--seed", "5"]


def as_postgres(*command, **kwargs) -> subprocess.CompletedProcess:
    """Run a server command as the postgres user (the server refuses to run as root)."""
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return subprocess.run([*prefix, *command], check=True, capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def postgres():
    if not SERVER:
        pytest.skip("needs a PostgreSQL server (apt-get install postgresql; .ci/run installs it)")
    pytest.importorskip("psycopg", reason="needs psycopg, SQLAlchemy's PostgreSQL driver (pip install -e '.[test]')")
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="dpsm_ray_postgres_"))  # outside pytest's root-only tmp: the server runs as postgres
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sockets, "postgres")
    bin_dir = Path(SERVER[-1])
    as_postgres(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:  # a start that times out after the server came up still stops it
        as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l", str(root / "server.log"),
                    "-o", f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1", "start")
        psql = ["psql", "-h", str(sockets), "-p", str(port), "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-c"]
        as_postgres(*psql, f"CREATE ROLE sweeper LOGIN PASSWORD '{PASSWORD}'")
        as_postgres(*psql, "CREATE DATABASE optuna OWNER sweeper")
        yield f"postgresql://sweeper:{PASSWORD}@127.0.0.1:{port}/optuna"
    finally:
        as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


def sweep(results: Path, url: str | None, *extra: str) -> subprocess.CompletedProcess:
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}
    env.pop("DPSM_RAY_OPTUNA_STORAGE", None)
    if url is not None:
        env["DPSM_RAY_OPTUNA_STORAGE"] = url
    return subprocess.run([sys.executable, str(ROOT / "sweeps" / "digits.py"), "--results-dir", str(results), *SWEEP, *extra],
                          capture_output=True, text=True, env=env, timeout=600)


def files_holding(text: str, roots: list[Path]) -> list[str]:
    found = []
    for root in roots:
        for path in root.rglob("*"):
            try:
                if path.is_file() and text.encode() in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue
    return found


def test_a_database_password_is_never_printed_pickled_or_stored(ray_session, postgres, tmp_path):
    results = tmp_path / "pg-sweep"
    run = sweep(results, postgres)
    assert run.returncode == 0, run.stdout + run.stderr
    assert PASSWORD not in run.stdout + run.stderr
    trials = pd.read_parquet(results / "trials.parquet")
    assert (trials.status == "ok").all() and sorted(trials.method) == ["base", "ce", "ce"]  # search, final, the base model
    # the study is in the database, with its trial and the join key to trials.parquet
    import optuna

    study = optuna.load_study(study_name="pg-sweep-ce", storage=postgres)
    assert [t.state.name for t in study.trials] == ["COMPLETE"]
    assert study.trials[0].user_attrs["run_id"] == trials[trials.stage == "search"].run_id.iloc[0]
    # nowhere on disk: the results directory (sweep.json, Tune's pickles, the run records) and the
    # Ray session directory Tune stages its driver files in (world-readable /tmp): the session's
    # own, which the sweep joined -- not other people's sessions on the machine
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert session.is_dir()
    assert not files_holding(PASSWORD, [results, session])
    assert "sweeper:***@127.0.0.1" in (results / "sweep.json").read_text()

    # a second sweep whose studies would collide is refused, the URL masked in the message
    taken = sweep(tmp_path / "other" / "pg-sweep", postgres)
    assert taken.returncode == 3 and "already holds the studies pg-sweep-ce" in taken.stderr and "sweeper:***@" in taken.stderr
    assert PASSWORD not in taken.stdout + taken.stderr
    # resuming needs the URL again (it is stored nowhere), and says where the studies are
    again = sweep(results, None, "--resume")
    assert again.returncode == 3 and "pass --optuna-storage with that URL (or set DPSM_RAY_OPTUNA_STORAGE)" in again.stderr
    assert "sweeper:***@127.0.0.1" in again.stderr and PASSWORD not in again.stderr
    # a wrong password is named without the password
    wrong = sweep(tmp_path / "third", postgres.replace(PASSWORD, "wrong-Pw-0815"))
    assert wrong.returncode == 3 and "cannot read the Optuna storage postgresql://sweeper:***@127.0.0.1" in wrong.stderr, wrong.stderr
    assert "wrong-Pw-0815" not in wrong.stdout + wrong.stderr
