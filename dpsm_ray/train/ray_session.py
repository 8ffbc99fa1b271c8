"""Which Ray a process uses, and whether it can hold what a run asks for.

A process joins a Ray cluster only when told to (``--address`` or ``RAY_ADDRESS``) or when a
cluster was started on this machine with ``ray start`` (the head node of a launcher cluster, where
``ray submit`` runs the script).  Otherwise it starts an embedded instance of its own: never
another process's embedded one, which dies with that process (``address="auto"`` would
join it).

Ray waits forever for resources it does not have (an autoscaler might add them), so before a run
starts its needs are checked: against an embedded instance at once (nothing will be added), and
against a cluster by asking for them as a placement group and waiting, up to a timeout, with one
line saying what is awaited.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_RESOURCE_TIMEOUT_S = 600.0


class InsufficientResources(RuntimeError):
    """A run asks for more CPUs or GPUs than the Ray it runs on has (the message names the options)."""


@dataclass(frozen=True)
class Session:
    address: str  # the GCS address
    embedded: bool  # started by this process: its capacity is all there will ever be


_embedded_address: str | None = None  # the instance this process started, if any


def current_session() -> Session | None:
    """The Ray this process is connected to, if any."""
    import ray

    if not ray.is_initialized():
        return None
    address = ray.get_runtime_context().gcs_address
    return Session(address, embedded=address == _embedded_address)


def ensure_ray(address: str | None = None, *, worker_output: bool = True) -> Session:
    """Connect to Ray as described in the module docstring (unless this process already is) and
    return the session.  ``worker_output=False`` keeps Ray workers' and actors' output out of this
    terminal (it stays in Ray's session logs): a sweep prints its own progress lines instead."""
    import ray

    session = current_session()
    if session is not None:
        return session
    address = address or os.environ.get("RAY_ADDRESS") or started_cluster_address()
    if not address:
        return start_embedded(worker_output=worker_output)
    try:
        ray.init(address=address, log_to_driver=worker_output)
    except ConnectionError as error:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address} ({error}); check --address / RAY_ADDRESS, or `ray stop` a stale local cluster"
        ) from None
    return current_session()


@contextlib.contextmanager
def leaving_ray_as_it_was():
    """A command that connects to (or starts) Ray disconnects when it ends; one run in a process
    that was connected already (a notebook, a test session) leaves that connection alone.  Ray is
    not imported for a command that never used it."""
    connected = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    try:
        yield
    finally:
        if not connected and "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()


def start_embedded(num_cpus: int | None = None, *, worker_output: bool = True, **init_options) -> Session:
    """Start a Ray instance private to this process (``address="local"``: never an existing one)."""
    global _embedded_address
    import ray

    _embedded_ray_settings()
    # Ray's own processes reach its state API (the dashboard) through RAY_API_SERVER_ADDRESS or
    # RAY_ADDRESS, else by scanning the machine for Ray instances, which fails once two run on it:
    # then Ray Train's placement-group cleaner dies and a trial Tune stops keeps its workers'
    # resources.  So the dashboard gets its port here and Ray's processes inherit its address.
    port = _free_local_port()
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    ray.init(
        address="local", num_cpus=num_cpus, log_to_driver=worker_output, dashboard_host="127.0.0.1", dashboard_port=port, **init_options
    )
    _embedded_address = ray.get_runtime_context().gcs_address
    # a driver killed with SIGKILL takes Ray's services with it but not its node agents: a watchdog
    # ends them (dpsm_ray/reaper.py)
    from dpsm_ray import reaper

    for raylet in reaper.children_named(os.getpid(), "raylet"):
        reaper.start(raylet)
    return current_session()


def _free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def started_cluster_address() -> str | None:
    """The address of a cluster started on this machine with ``ray start`` (recorded by Ray in
    its temp directory; ``ray stop`` removes it), or None."""
    from dpsm_ray.train.ray_private import bootstrap_address  # what a plain ray.init() reads

    return bootstrap_address()


def _embedded_ray_settings() -> None:
    """Settings for a Ray instance this process starts itself (a laptop, CI), set before
    ``ray.init`` so Ray's own processes inherit them.  Ray Train polls its workers every 2 s by
    default, which adds ~10 s to every short run; 0.2 s halves a digits trial.  Ray's warning
    that a local instance has token authentication (its default, which this service wants) and
    how to turn it off asks nothing of the user: its logger is set to errors only."""
    import logging

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    from dpsm_ray.train.ray_private import AUTHENTICATION_LOGGER

    logging.getLogger(AUTHENTICATION_LOGGER).setLevel(logging.ERROR)


# --- capacity -------------------------------------------------------------------------------

_RESOURCES = ("CPU", "GPU")


@dataclass(frozen=True)
class Demand:
    """What one run holds at once: its own process's share (a Tune trial's; empty for a command
    that drives its workers from the terminal's process) and ``workers`` Ray Train workers
    holding ``per_worker`` each."""

    own: dict[str, float]
    workers: int
    per_worker: dict[str, float]
    in_process: bool = False  # --workers 0: a Tune trial that trains in its own process

    @property
    def bundles(self) -> list[dict[str, float]]:
        positive = [{k: v for k, v in bundle.items() if v > 0} for bundle in [self.own] + [self.per_worker] * self.workers]
        return [bundle for bundle in positive if bundle]

    def total(self, resource: str) -> float:
        return sum(bundle.get(resource, 0.0) for bundle in self.bundles)

    def fits(self, have: dict[str, float]) -> bool:
        return all(self.total(k) <= have.get(k, 0.0) + 1e-9 for k in _RESOURCES)

    def describe(self) -> str:
        if self.in_process:
            return f"--workers 0: each trial trains in its own process, holding {amounts(self.own)} (--cpus-per-worker, --gpus-per-worker)"
        per = " and ".join(
            f"--{flag} {self.per_worker[k]:g}"
            for k, flag in (("CPU", "cpus-per-worker"), ("GPU", "gpus-per-worker"))
            if self.per_worker.get(k, 0) > 0
        )
        own = f"{amounts(self.own)} for the trial's own process + " if self.own else ""
        return f"{own}--workers {self.workers} x {per}"

    def shown(self, have: dict[str, float]) -> list[str]:
        """The resources worth naming: CPUs, and GPUs when asked for or present."""
        return [k for k in _RESOURCES if k == "CPU" or self.total(k) > 0 or have.get(k, 0) > 0]

    def shortfall(self, have: dict[str, float], where: str) -> str:
        """Why ``have`` cannot hold this demand, naming the options that set it."""
        shown = self.shown(have)
        advice = "lower --cpus-per-worker or --gpus-per-worker"
        if not self.in_process:
            room = [math.floor((have.get(k, 0.0) - self.own.get(k, 0.0)) / v + 1e-9) for k, v in self.per_worker.items() if v > 0]
            advice = (
                f"at most --workers {max(0, min(room))} fit with these per-worker values: lower --workers, --cpus-per-worker or"
                " --gpus-per-worker"
            )
        return (
            f"a run needs {amounts({k: self.total(k) for k in shown})} at once ({self.describe()}), but {where} has"
            f" {amounts({k: have.get(k, 0.0) for k in shown})}; {advice}"
        )



def run_demand(workers: int, cpus_per_worker: float, gpus_per_worker: float, own: dict[str, float] | None = None) -> Demand:
    """The demand of one run: ``workers`` Ray Train workers plus ``own`` (a Tune trial's share,
    in Tune's ``{"cpu": .., "gpu": ..}`` or Ray's ``{"CPU": ..}`` spelling); with ``workers == 0``
    a Tune trial training in its own process, holding ``own`` (default: the per-worker values)."""
    per_worker = {"CPU": float(cpus_per_worker), "GPU": float(gpus_per_worker)}
    own = {k.upper(): float(v) for k, v in own.items()} if own is not None else ({} if workers else per_worker)
    return Demand(own=own, workers=workers, per_worker=per_worker, in_process=workers == 0)


def _cluster_capacity() -> dict[str, float]:
    import ray

    return {k: float(v) for k, v in ray.cluster_resources().items() if k in _RESOURCES}


def check_before_start(demand: Demand, address: str | None = None) -> None:
    """Before any Ray work: when ``ensure_ray(address)`` would start an embedded instance, raise
    ``InsufficientResources`` at once if that instance could not hold ``demand`` (starting Ray
    takes ~10 s on 2 cores; what it would count is known without it)."""
    if current_session() is not None or address or os.environ.get("RAY_ADDRESS") or started_cluster_address():
        return
    import torch
    from dpsm_ray.train.ray_private import ray_cpu_count

    _embedded_fits(demand, {"CPU": float(ray_cpu_count()), "GPU": float(torch.cuda.device_count())})


def check_capacity(demand: Demand, *, timeout_s: float = DEFAULT_RESOURCE_TIMEOUT_S, log: Callable[[str], None] | None = None) -> None:
    """Raise ``InsufficientResources`` unless the current Ray can hold ``demand`` (see the module
    docstring): at once on an embedded instance, after up to ``timeout_s`` on a cluster."""
    session = current_session()
    if session is not None and session.embedded:
        _embedded_fits(demand, _cluster_capacity())
        return
    wait_for(demand, timeout_s, log or _stderr)


def _embedded_fits(demand: Demand, have: dict[str, float]) -> None:
    if not demand.fits(have):
        raise InsufficientResources(demand.shortfall(have, "the embedded Ray on this machine") + ", or pass --address of a larger cluster")


def wait_for(demand: Demand, timeout_s: float, log: Callable[[str], None]) -> None:
    """Ask a cluster for ``demand`` as a placement group (what an autoscaler acts on), wait until
    it could be placed, and give it back; raise after ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(demand.bundles, strategy="PACK")  # Ray Train's own strategy
    try:
        ready, _ = ray.wait([group.ready()], timeout=min(2.0, timeout_s))
        if not ready:
            have = _cluster_capacity()
            shown = demand.shown(have)
            log(f"waiting up to {timeout_s:.0f}s for the Ray cluster to provide {amounts({k: demand.total(k) for k in shown})} "
                f"({demand.describe()}); it has {amounts({k: have.get(k, 0.0) for k in shown})} now and an autoscaler may add nodes "
                "(--resource-timeout sets the wait)")
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, timeout_s - 2.0))
    finally:
        remove_placement_group(group)
    if not ready:
        raise InsufficientResources(
            demand.shortfall(_cluster_capacity(), f"after {timeout_s:.0f}s the Ray cluster")
            + ", or raise --resource-timeout if nodes are still coming"
        )


def amounts(resources: dict[str, float]) -> str:
    """``{"CPU": 2.1, "GPU": 0}`` -> "2.1 CPUs and 0 GPUs"."""
    return " and ".join(f"{v:g} {k}{'' if v == 1 else 's'}" for k, v in resources.items())


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
