"""How the driver reaches Ray: the cluster RAY_ADDRESS names, a live local head of the
user's own, or a private instance of its own; and how a region's agent reaches its own
cluster (:func:`connect_region`).

``ray.init()`` without an address joins the cluster named in Ray's
``ray_current_cluster`` file (written by ``ray start --head``), and refuses
``num_cpus`` when it does, even when the file is stale (its head was killed). The
decision is made here instead, as a pure function of what the environment says, so a
user with a local head gets a run on it (and a line saying so) and a user with a stale
file gets a private instance, as with no file at all.

Ray keeps that file in a world-writable folder (``/tmp/ray``), so another local user can
write it and point it at a head of theirs, which would then receive this run's code and
data and hand the driver results to unpickle. The file is followed only when it and its
folder belong to this user (:func:`foreign_owner`); otherwise the run starts a private
instance and says why.
"""

from __future__ import annotations

import math
import os
import socket
import stat
import tempfile
import time
from typing import Callable, Optional

from diloco_ray.config.sections import MembershipSection, PlacementSection
from diloco_ray.errors import ConfigError, first_line
from diloco_ray.logs import log


def decide(
    env_address: Optional[str], file_address: Optional[str], alive: bool, owned: bool = True
) -> tuple[str, Optional[str]]:
    """``("join", address)``, or ``("start", None)`` for a private local instance.

    Args:
        env_address: ``RAY_ADDRESS`` (``ray job submit`` sets it); ``local`` asks for a
            private instance.
        file_address: the ``host:port`` in Ray's ``ray_current_cluster`` file, if any.
        alive: whether something answers at ``file_address``.
        owned: whether that file and its folder belong to this user (a file another
            user wrote is never followed).
    """
    if env_address and env_address != "local":
        return "join", env_address
    if env_address == "local" or not file_address or not alive or not owned:
        return "start", None
    return "join", file_address


def foreign_owner(path: str, uid: Optional[int] = None) -> Optional[str]:
    """Why the cluster file ``path`` is not this user's to follow, or None when it and its
    folder are owned by ``uid`` (default: this process's) and the file is no link."""
    uid = os.getuid() if uid is None else uid
    for what, where in (("file", path), ("folder", os.path.dirname(path) or os.curdir)):
        try:
            st = os.lstat(where)
        except OSError as e:
            return f"cannot read {where}: {e.strerror}"
        if what == "file" and stat.S_ISLNK(st.st_mode):
            return f"{where} is a link"
        if st.st_uid != uid:
            return f"the {what} {where} belongs to uid {st.st_uid}, not to you (uid {uid})"
    return None


def cluster_file() -> str:
    """Where ``ray start --head`` notes the local cluster's address."""
    try:
        from ray._common.utils import get_ray_address_file

        return get_ray_address_file(None)
    except ImportError:  # another Ray layout: its documented default
        return os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster")


def answers(address: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds (a live GCS listens there)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def connect(membership: MembershipSection, placement: PlacementSection) -> bool:
    """Connect this process to Ray as :func:`decide` says; returns whether it started a
    private instance (which the trainer then shuts down), sized by :func:`logical_cpus`."""
    import ray

    env = os.environ.get("RAY_ADDRESS")
    path = cluster_file()
    try:
        with open(path) as f:
            recorded = f.read(256).strip() or None
    except OSError:
        recorded = None
    foreign = foreign_owner(path) if recorded and not env else None
    mode, address = decide(env, recorded, recorded is not None and answers(recorded), owned=foreign is None)
    if mode == "join":
        if not env:
            log.info(
                "joining the running local Ray cluster at %s (set RAY_ADDRESS=local to start a private one)", address
            )
        ray.init(address=address)
        return False
    if foreign:
        log.warning("not joining the local Ray cluster that %s names: %s; starting a private one", path, foreign)
    ray.init(address="local", num_cpus=logical_cpus(membership, placement), include_dashboard=False, log_to_driver=True)
    return True


REGION_CPUS = 8  # a region's private Ray's logical CPUs at least: rank actors reserve fractions of them
REGION_START_TRIES = 3  # starts of a region's private Ray before its agent gives up


def connect_region(log_line: Callable[[str], None]) -> bool:
    """Connect a region's agent to its cluster: the one ``RAY_ADDRESS`` names, else a
    private Ray with room for several replicas (logical CPUs, as the trainer's private Ray
    has), tried again when a busy machine's head misses Ray's own start-up deadline.
    Returns whether it started the private one."""
    import ray

    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address)
        return False

    def start() -> None:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, REGION_CPUS), include_dashboard=False)

    for attempt in range(1, REGION_START_TRIES):
        try:
            start()
            return True
        except Exception as e:
            ray.shutdown()
            log_line(f"region: Ray did not start ({first_line(e)}); trying again ({attempt} of {REGION_START_TRIES})")
            time.sleep(2.0 * attempt)
    start()  # the last try: what stops it is the agent's error
    return True


def logical_cpus(membership: MembershipSection, placement: PlacementSection) -> int:
    """The logical CPUs a private local Ray gets: room for the servers, every replica that
    may run and the hot spares. Logical CPUs, not cores: rank actors reserve
    ``cpus_per_rank`` each, and a laptop with fewer cores than ranks should still run the
    job (just slower); without the spares' share a spare would never be placed."""
    return max(os.cpu_count() or 1, math.ceil(cpus_needed(membership, placement)))


def cpus_needed(membership: MembershipSection, placement: PlacementSection) -> float:
    """The CPUs a job reserves at most: its servers, every replica it may run and its hot
    spares (a sweep sizes how many trials run side by side by it too)."""
    replicas = membership.replica_bounds[1] + membership.spare_replicas
    ranks = replicas * placement.max_ranks
    return placement.server_cpus * placement.num_param_servers + ranks * placement.cpus_per_rank


def resolve_device(want: str) -> str:
    """``device`` (auto, cpu, cuda) as the connected cluster can serve it."""
    import ray

    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if want == "cuda" and not has_gpu:
        raise ConfigError("device: 'cuda' but the Ray cluster has no GPUs; use device: cpu or auto")
    return "cuda" if want == "cuda" or (want == "auto" and has_gpu) else "cpu"


def on_sigterm(stopped) -> object:
    """Make SIGTERM call ``stopped(signal name)`` (which raises), in the main thread only;
    returns the handler it replaced (None when not installed). Installed once Ray is
    connected, since ``ray.init`` sets its own handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda signum, frame: stopped(signal.Signals(signum).name))
