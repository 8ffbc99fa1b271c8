"""The cluster path as a user runs it: docs/cluster.md's `ray up` / `ray submit` / `ray rsync-down` /
`ray down` commands, verbatim, with cluster/local.yaml filled in as docs/cluster.md says -- against a
"machine" reached over SSH: an sshd this test starts on 127.0.0.1 with its own host key, client key
and config (the machine's own ssh setup is not touched).  A second Ray node joins the head on this
same machine under the address 127.0.0.2, so that a sweep's trials run on two nodes, and one of them
is killed in the middle of a sweep.

`ray up` and `ray down` run `ray stop`, which ends every Ray process of this user on the machine:
these tests are marked `cluster`, and tests/conftest.py runs them before any other test of the run
can start Ray, and skips them while a Ray the run did not start is running.  The remote login
shell's environment comes from the remote ~/.bashrc (the launcher resets PATH): the test gives the
node a home of its own (sshd's SetEnv HOME) whose .bashrc puts this machine's Python on PATH, as a
user's machine would have it.  sshd's SetEnv also gives the node's processes the test run's mark,
so that they count as the run's (tests/suite_processes.py).
"""

import contextlib
import getpass
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import suite_processes
import yaml

from dpsm_ray import reaper

pytestmark = pytest.mark.cluster
OWNS_THE_MACHINES_RAY = "`ray up` and `ray down` run `ray stop`, which would end it"  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
HEAD, WORKER = "127.0.0.1", "127.0.0.2"
EPOCHS = 80  # of each trial of the node-loss sweep
TOOLS = {"sshd": shutil.which("sshd") or "/usr/sbin/sshd", "ssh-keygen": shutil.which("ssh-keygen"), "rsync": shutil.which("rsync"), "nc": shutil.which("nc")}
MISSING = [name for name, path in TOOLS.items() if not path or not Path(path).exists()]
if MISSING:
    pytest.skip(f"needs {', '.join(MISSING)} (apt-get install openssh-server rsync netcat-openbsd; .ci/run installs them)", allow_module_level=True)


@dataclass
class Machines:
    """The SSH side of the two nodes: where sshd listens, the key it accepts, the nodes' home."""

    port: int
    key: Path
    home: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HEAD, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    import ray

    assert not ray.is_initialized(), "a cluster test must run before this session starts Ray (tests/conftest.py orders them)"
    root = tmp_path_factory.mktemp("machines")
    ssh, home = root / "ssh", root / "home"
    ssh.mkdir()
    home.mkdir()
    for name in ("host_key", "id_ed25519"):
        subprocess.run([TOOLS["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / name)], check=True)
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    # the nodes' Python is this machine's (the one running the tests); pip's cache is shared so
    # that installing the project on a "node" does not download what this machine already has
    (home / ".bashrc").write_text(f"export PATH={Path(sys._base_executable).parent}:$PATH\nexport PIP_CACHE_DIR={Path.home() / '.cache' / 'pip'}\n")
    make_node_venv(home / "dpsm_ray_venv")
    port = free_port()
    (ssh / "sshd_config").write_text("\n".join([
        f"Port {port}", f"ListenAddress {HEAD}",
        f"HostKey {ssh / 'host_key'}", f"AuthorizedKeysFile {ssh / 'authorized_keys'}", f"PidFile {ssh / 'sshd.pid'}",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
        "UsePAM no", "StrictModes no", f"SetEnv HOME={home} {suite_processes.MARKER}={os.environ[suite_processes.MARKER]}", "",
    ]))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    log = (root / "sshd.log").open("w")
    sshd = subprocess.Popen([TOOLS["sshd"], "-D", "-e", "-f", str(ssh / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((HEAD, port), timeout=1).close()
                break
            except OSError:
                assert sshd.poll() is None and time.monotonic() < deadline, (root / "sshd.log").read_text()
                time.sleep(0.2)
        yield Machines(port=port, key=ssh / "id_ed25519", home=home)
    finally:
        # sshd and the connections it still serves (one process each, under it)
        under = reaper.descendants(sshd.pid)
        sshd.terminate()
        sshd.wait(timeout=20)
        for pid, started in under.items():
            if reaper.start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)


def make_node_venv(venv: Path) -> None:
    """The nodes' ~/dpsm_ray_venv, made before `ray up` as a first `ray up` leaves it, but holding
    only this machine's installed packages, seen through a .pth line: the setup command
    `pip install -e ~/dpsm-ray` then finds every dependency satisfied and installs the project
    alone.  A second copy of torch, its CUDA libraries and Ray (~6 GB) filled a CI machine's disk.
    Their console scripts (`ray`, run by every remote command) are copied with this venv's Python
    on their first line, as pip writes them."""
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    (Path(site_packages) / "this_machines_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    ours = Path(sys.prefix) / "bin"
    for script in ours.iterdir():
        if (venv / "bin" / script.name).exists() or not script.is_file():
            continue
        with script.open("rb") as opened:
            first = opened.readline()
        if first.startswith(b"#!" + str(ours).encode() + b"/python"):
            (venv / "bin" / script.name).write_bytes(b"#!" + str(python).encode() + b"\n" + script.read_bytes()[len(first):])
            (venv / "bin" / script.name).chmod(0o755)


def checkout_copy(destination: Path) -> None:
    """This checkout's files (tracked, and new files git does not ignore), as a user's clone."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def fill_in(config_path: Path, machines: Machines) -> None:
    """Edit cluster/local.yaml as docs/cluster.md tells a user to: the head's address, the SSH user and
    key, and (sshd on a port other than 22) the proxy command.  The worker node is started by
    hand instead (see the test): the head's autoscaler would reach a worker_ips machine with
    `ssh -i ~/ray_bootstrap_key.pem` on port 22, and ssh expands ~ from the password database,
    not from the HOME this test gives the nodes."""
    config = yaml.safe_load(config_path.read_text())
    # a name of its own: the launcher keys its SSH connection sharing (ControlPath) on the cluster
    # name, and must not reuse a connection another run left open to another sshd
    config["cluster_name"] = f"dpsm-ray-test-{uuid.uuid4().hex[:8]}"
    config["provider"].update(head_ip=HEAD, worker_ips=[])
    config["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(machines.key), "ssh_proxy_command": f"nc %h {machines.port}"}
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))


def readme_cluster_commands() -> list[str]:
    """The first block of `ray ...` commands in docs/cluster.md's section on one's own machines."""
    section = (ROOT / "docs" / "cluster.md").read_text().split("## On your own machines", 1)[1].split("\n## ", 1)[0]
    commands, started = [], False
    for line in section.splitlines():
        if line.startswith("    ray "):
            commands.append(line.strip())
            started = True
        elif started:
            break
    return commands


def ray_cli(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``command`` as pasted into a shell; past ``timeout``, it and every process it started in its
    session are killed."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    shell = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = shell.communicate(timeout=timeout)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.communicate()
    run = subprocess.CompletedProcess(shell.args, shell.returncode, stdout, stderr)
    print(f"{time.monotonic() - started:6.1f}s  {command}  -> exit {run.returncode}")
    assert run.returncode == 0, f"{command}\n{run.stdout[-6000:]}\n{run.stderr[-6000:]}"
    return run


def ray_processes() -> list[str]:
    """This test run's Ray processes (the "machine"'s carry its mark), as ``pid args`` lines."""
    ours = suite_processes.started_by(suite_processes.this_run())
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines()
            if re.search(r"raylet|gcs_server|ray::|dashboard/agent.py|default_worker.py|monitor.py", line) and int(line.split()[0]) in ours]


def end_this_runs_ray() -> None:
    """What `ray down` does to this machine, for this test run's Ray processes alone (the nodes'
    processes carry the run's mark; their agents and workers are under their raylets): they are
    killed, and the address file a plain driver would read is removed once nothing answers at the
    address it names (the head's)."""
    ray = re.compile(r"site-packages/ray/|^ray::|^ray-dashboard-|-m ray\.")
    for process in suite_processes.started_by(suite_processes.this_run()).values():
        if ray.search(process.command):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
    time.sleep(2)
    address_file = Path("/tmp/ray/ray_current_cluster")
    with contextlib.suppress(OSError, ValueError):
        host, port = address_file.read_text().strip().rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except ConnectionRefusedError:
            address_file.unlink()


def worker_node_pids() -> list[int]:
    """The processes of the Ray node started with --node-ip-address=127.0.0.2 (its raylet and the
    workers it launched)."""
    pids = []
    for line in ray_processes():
        if re.search(rf"node.ip.address[= ]{re.escape(WORKER)}\b", line):
            pids.append(int(line.split()[0]))
    return pids


def trials_on_worker() -> list[int]:
    """Processes that the worker node's raylet runs a task or actor in (Ray titles a busy worker
    ``ray::<task or actor>``, an idle one ``ray::IDLE``; the node's own agents are
    ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``, Ray's internal actors ``ray::_...``).
    Read from the processes themselves: Tune's result.json under the results directory is a copy
    synced every so often, which a trial of a few seconds can start and finish between two syncs
    (seen: every trial of the sweep below missed on a quiet machine)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True, check=True).stdout.splitlines()[1:]
    rows = [line.split(None, 2) for line in ps if len(line.split(None, 2)) == 3]
    raylets = {int(pid) for pid, _, args in rows if "raylet" in args and re.search(rf"node.ip.address[= ]{re.escape(WORKER)}\b", args)}
    return [int(pid) for pid, ppid, args in rows
            if int(ppid) in raylets and args.startswith("ray::") and not re.match(r"ray::(IDLE\b|DashboardAgent\b|RuntimeEnvAgent\b|_)", args)]


def assert_strangers_are_refused(tmp_path: Path) -> None:
    """Issue 21: the cluster runs with token authentication and its dashboard on loopback.  A
    driver without the token cannot join, the dashboard's job API answers 401 without it and 200
    with it, and nothing listens on the dashboard's port at the machine's other address."""
    import urllib.error
    import urllib.request

    # the stranger's Ray gives up after two tries (its default: ~20 one-second tries, a wait that tells nothing more)
    stranger = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path / "stranger"), "RAY_gcs_server_port_wait_time_s": "2"}
    joined = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{HEAD}:6379'); print('JOINED')"],
                            env=stranger, capture_output=True, text=True, timeout=300)
    assert joined.returncode != 0 and "JOINED" not in joined.stdout, joined.stdout + joined.stderr[-3000:]
    assert re.search(r"Unauthenticated|AuthenticationError|authentication token", joined.stdout + joined.stderr), joined.stderr[-3000:]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{HEAD}:8265/api/jobs/", timeout=30)
    assert refused.value.code == 401
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    request = urllib.request.Request(f"http://{HEAD}:8265/api/version", headers={"Authorization": f"Bearer {token}"})
    assert urllib.request.urlopen(request, timeout=30).status == 200
    outward = socket.gethostbyname(socket.gethostname())
    if not outward.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((outward, 8265), timeout=5).close()


def test_the_readme_cluster_commands_on_two_nodes_with_a_node_lost_mid_sweep(machines, tmp_path):
    checkout = tmp_path / "dpsm_ray"
    checkout_copy(checkout)
    fill_in(checkout / "cluster" / "local.yaml", machines)
    token, up, submit, rsync_down, down = commands = readme_cluster_commands()
    sweep = None
    assert [c.split()[:2] for c in commands] == [["ray", "get-auth-token"], ["ray", "up"], ["ray", "submit"], ["ray", "rsync-down"], ["ray", "down"]], commands
    assert "> /dev/null" in token  # the secret is not printed

    # tests/conftest.py looked before the machines were set up (a minute); `ray up` runs `ray stop`
    if foreign := suite_processes.foreign_rays(suite_processes.this_run()):
        pytest.skip(f"a Ray this test run did not start has started meanwhile (pids {[p.pid for p in foreign]}): `ray up` runs `ray stop`")
    finished = False
    try:
        assert not ray_cli(token, checkout, timeout=120).stdout  # creates ~/.ray/auth_token where it is missing
        ray_cli(up, checkout, timeout=1200)
        # the nodes run the copy of the checkout that `ray up` synced and installed
        imported = subprocess.run([str(machines.home / "dpsm_ray_venv" / "bin" / "python"), "-c", "import dpsm_ray; print(dpsm_ray.__file__)"],
                                  capture_output=True, text=True, check=True, cwd=machines.home, env={**os.environ, "HOME": str(machines.home)}).stdout
        assert Path(imported.strip()).is_relative_to(machines.home / "dpsm-ray"), imported
        assert_strangers_are_refused(tmp_path)
        # a second node on this machine, with an address of its own, joins the head's cluster
        config = shlex.split(up)[-1]
        joined = ray_cli(f"ray exec {config} 'ray start --address={HEAD}:6379 --node-ip-address={WORKER}'", checkout, timeout=300)
        deadline = time.monotonic() + 60
        while not worker_node_pids():
            assert time.monotonic() < deadline, "the worker node did not start:\n" + joined.stdout[-3000:] + "\n".join(ray_processes())
            time.sleep(1)

        # 1. the documented sweep, its results copied back
        run = ray_cli(submit, checkout, timeout=1200)
        finished, forwarded = "sweep finished" in run.stdout, re.findall(r"\(\w+ pid=\d+\).*", run.stdout)
        assert finished and not forwarded, run.stdout[-4000:]  # one line per trial: no worker output
        ray_cli(rsync_down, checkout, timeout=300)
        *_, remote, local = shlex.split(rsync_down)
        local_results = checkout / local / Path(remote).name  # rsync copies the directory into local/
        trials = pd.read_parquet(local_results / "trials.parquet")
        assert len(pd.read_parquet(local_results / "evals.parquet")) and len(pd.read_parquet(local_results / "epochs.parquet"))
        assert trials.status.eq("ok").all() and trials.trial_id.is_unique
        # where they ran: the head (under this machine's address: Ray replaces 127.0.0.1 by it) and
        # maybe the worker.  These trials last a second or less, and a stage's trials reuse the
        # processes that are up already (dpsm_ray/sweep/stage.py), so the head's two may serve them
        # all before a process on the worker is ready; the sweep below gives the worker its trials.
        assert trials.node_ip.notna().all() and len(set(trials.node_ip) - {WORKER}) == 1, set(trials.node_ip)

        # 2. a worker node lost mid-sweep: its trial restarts from its checkpoint elsewhere, and
        # every trial is recorded once
        results = machines.home / "results" / "faults"
        # trials long enough for the poll below to catch one running on the worker: with 12 epochs
        # (~0.1 s each once a trial has started) a quiet machine finished every trial between two
        # polls; EPOCHS gives each trial seconds of epochs.  A process per trial: a trial waiting for
        # the worker's process would otherwise take one of the head's as soon as it is free (reuse)
        faulty = (submit.split(" -- ")[0] + f" -- --results-dir {results} --methods ce,cut --trials 3 --final-seeds 1 --concurrency 4 --epochs {EPOCHS}"
                  " --process-per-trial")
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        sweep = subprocess.Popen(shlex.split(faulty), cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        killed, seen = [], {}
        deadline = time.monotonic() + 900
        while not killed and sweep.poll() is None and time.monotonic() < deadline:
            now = time.monotonic()
            seen = {pid: seen.get(pid, now) for pid in trials_on_worker()}  # when each was first seen busy
            training = [pid for pid, since in seen.items() if now - since >= 5]  # past its start-up (~3-5 s here), into its epochs
            if training:
                killed = training + worker_node_pids()
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        output = sweep.communicate(timeout=900)[0][-6000:]
        assert killed, "no trial ran on the worker node to be interrupted\n" + output
        assert sweep.returncode == 0, output
        trials = pd.read_parquet(results / "trials.parquet")
        search = trials[trials.stage == "search"]
        final = trials[trials.stage == "final"]
        assert search.groupby("method").size().to_dict() == {"ce": 3, "cut": 3} and sorted(final.method) == ["base", "ce", "cut"]
        trained = trials[trials.method != "base"]  # the base model is evaluated as it is: 0 epochs
        assert trials.trial_id.is_unique and trials.status.eq("ok").all() and trained.epochs_completed.eq(EPOCHS).all()
        epochs = pd.read_parquet(results / "epochs.parquet")
        assert not epochs.duplicated(["trial_id", "epoch"]).any() and len(epochs) == EPOCHS * len(trained)
        finished = True
    finally:
        if sweep is not None and sweep.poll() is None:  # the test failed while it ran: it goes with the cluster
            sweep.kill()
            sweep.communicate()
        if foreign := suite_processes.foreign_rays(suite_processes.this_run()):
            # `ray down`'s `ray stop` would end it too: this run's cluster is ended by hand instead
            end_this_runs_ray()
            assert not finished, f"a Ray this test run did not start appeared during the test (pids {[p.pid for p in foreign]}): `ray down` was not run"
        else:
            ray_cli(down, checkout, timeout=600)
    deadline = time.monotonic() + 60
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(1)
    assert not ray_processes(), "left running after `ray down`:\n" + "\n".join(ray_processes())
