"""Network namespaces joined by shaped veth links: what both of ``bench/wan.py``'s layouts
build on (:mod:`wanlab.bridge`: one Ray cluster over a bridge; :mod:`wanlab.router`: regions
as separate clusters behind a router).

A :class:`Site` is one namespace and the two ends of its veth pair: the host end (in the
root namespace or a router's) whose counters are read, and the namespace end. A
:class:`Lab` owns what a layout builds: one at a time per layout (a lock file; the names
are fixed, and set-up clears what a killed run left), and everything torn down on any exit
of ``with``: SIGINT, SIGTERM and SIGHUP are turned into exceptions so they take the same
path. Needs root and ``ip``/``tc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
SIOCETHTOOL = 0x8946
ETHTOOL_OFF = (0x1F, 0x24, 0x2C)  # ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO


def sh(*cmd: str, check: bool = True) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def why_not_available() -> str | None:
    """None when namespaces and shaped links can be built here, else the reason (for a skip message)."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command"
    probe = f"dlp-probe-{os.getpid()}"  # root in a container may still lack CAP_NET_ADMIN
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode:
        return f"cannot make a network namespace here ({made.stderr.strip() or made.returncode})"
    return None


@dataclass(frozen=True)
class Site:
    """One namespace: its name, its veth pair's two ends and its address (``gateway``: the
    host end's address, where it has one of its own)."""

    name: str
    index: int
    prefix: str
    ip: str
    gateway: str | None = None

    @property
    def netns(self) -> str:
        return f"{self.prefix}-{self.name}"

    @property
    def host_end(self) -> str:
        """The end outside the namespace: the one whose counters are read."""
        return f"{self.prefix}{self.index}h"

    @property
    def ns_end(self) -> str:
        return f"{self.prefix}{self.index}n"

    @property
    def resource(self) -> str:
        """The custom Ray resource a node in this namespace advertises (the bridge layout's pins)."""
        return f"region-{self.name}"


class Interrupted(BaseException):
    """SIGTERM/SIGHUP, raised so ``finally`` blocks run as they do for Ctrl-C."""


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


class Lab:
    """What one layout builds, as a context manager: its lock held and its signals turned
    into exceptions while it is up, :meth:`close` on any exit (and before building, for what
    an earlier, killed run left). A layout sets ``prefix`` and implements :meth:`build` and
    :meth:`close`."""

    prefix = "dl"

    @property
    def lock_path(self) -> str:
        return f"/tmp/{self.prefix}-wan.lock"

    @classmethod
    def leftovers(cls) -> list[str]:
        """What a layout of this kind left on the machine (empty after a clean exit)."""
        return leftovers(cls.prefix)

    def build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._lock = open(self.lock_path, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"another bench/wan.py holds {self.lock_path}; wait for it to finish") from None
        self._old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
        # A background job of a non-interactive shell starts with SIGINT ignored: take it back.
        self._old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.close()
            self.build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            for sig, handler in self._old.items():
                signal.signal(sig, handler)
            self._lock.close()  # releases the lock


def shape(site: Site, rate_mbit: float, burst: int, router: str | None = None) -> None:
    """Both directions of ``site``'s link to ``rate_mbit`` (tbf: a rate, no delay): the host
    end's egress is what flows into the namespace (down), the namespace end's what flows out
    (up). ``router``: the namespace the host end lives in (None: the root namespace)."""
    spec = ("root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms")
    outside = ("ip", "netns", "exec", router) if router else ()
    sh(*outside, "tc", "qdisc", "replace", "dev", site.host_end, *spec)
    sh("ip", "netns", "exec", site.netns, "tc", "qdisc", "replace", "dev", site.ns_end, *spec)


def pids_in(netns: str) -> list[str]:
    return sh("ip", "netns", "pids", netns, check=False).split()


def namespaces(prefix: str) -> list[str]:
    """The namespaces on this machine whose names start with ``prefix-``."""
    names = [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{prefix}-")]


def leftovers(prefix: str) -> list[str]:
    """Namespaces, links and Ray processes (temp dirs ``/tmp/{prefix}ray*``) of ``prefix`` still on the machine."""
    found = [f"netns {n}" for n in namespaces(prefix)]
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(prefix):
            found.append(f"link {link}")
    procs = sh("pgrep", "-af", f"/tmp/{prefix}ray", check=False).splitlines()
    return found + [f"process {p[:80]}" for p in procs if "pgrep" not in p]


@contextlib.contextmanager
def in_netns(netns: str):
    """This thread in network namespace ``netns`` (sockets made here live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(there, CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            yield
        finally:
            libc.setns(own, CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(there)


def offloads_off(netns: str, dev: str) -> None:
    """TSO, GSO and GRO off on ``dev`` (``ethtool -K``, which this machine lacks): tbf and
    the counters then see every frame as a wire carries it, with its own headers, and the
    receiver acknowledges wire-sized segments (every second one), not 64 kB aggregates."""
    with in_netns(netns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for cmd in ETHTOOL_OFF:
            value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifreq = struct.pack("16sP", dev.encode(), ctypes.addressof(value)) + bytes(16)
            fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)


def kill(pids: list[str], grace_s: float = 2.0) -> None:
    """SIGTERM, up to ``grace_s`` to exit, then SIGKILL. What stops on SIGTERM does so within
    0.2 s here; a GCS, raylet or runtime-env agent whose cluster is going down with it still
    runs 10 s later, so a longer wait only delays its SIGKILL (every worker is in ``pids``)."""
    pids = [int(p) for p in pids if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie does not: it has exited, and here (a container
    whose init does not reap orphans) it may never be reaped, which made every wait 10 s."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
