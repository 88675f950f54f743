"""Regions as separate Ray clusters over shaped links, joined only by the channel (used by ``bench/wan.py --regions``).

:class:`RegionNet` builds one network namespace per region (``home``, the first, runs the
driver, the servers, its own replicas and the channel's port; every other region runs
``diloco-ray region`` on a private Ray cluster of its own) and one router namespace. Each
region is joined to the router by a veth pair on a subnet of its own, shaped with ``tc tbf``
in both directions (the router end's egress is what flows into the region, down; the
region end's egress what flows out, up). The router does not forward IP: the only way
across is the delaying relay (:mod:`wan_relay`) it runs on the channel's port, which every
region dials (``gateway(region):RELAY_PORT``) and which connects on to the home's channel.
So a message from a region crosses its own link, the relay and the home's link; the delay
is the relay's, added once each way.

Frames as a wire carries them: TSO, GSO and GRO are off on every veth end (an ioctl, as
``ethtool -K`` would), so tbf and the counters see wire-sized frames, each with its own
headers, and the receiver acknowledges wire-sized segments; with them on, a veth hands tbf
64 kB super-packets that pass whole when they fit its bucket (one set of headers each,
and fewer acknowledgements). tbf's bucket holds 10 full frames, or 1 ms at
the rate when that is more: a short burst at line rate, as a switch port's buffer allows.

Bytes are read from the router ends' counters (``/proc/PID/net/dev`` of a process in the
router namespace): ``rx`` there is what the region sent, ``tx`` what it received. An outage
is ``ip link set DEV down`` on the router end of one region's link, then ``up``: frames are
dropped silently both ways, as on a cut cable.

Everything is torn down by :meth:`RegionNet.close` (every process in the namespaces, the
namespaces and their links, the Ray temp dir) on any exit of ``with RegionNet(...)``;
SIGINT, SIGTERM and SIGHUP take the same path (:mod:`wan_links`' discipline). The prefix
differs from :mod:`wan_links`', and so does the lock, so the two cannot collide. Needs root.
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
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wan_links import _Interrupted, _kill, _raise_interrupted, sh, why_not_available  # noqa: E402,F401

PREFIX = "dlr"  # every namespace and link this module makes starts with it (wan_links: "dlw")
ROUTER = f"{PREFIX}-router"
SUBNET = "10.214"  # region i's link: 10.214.i.0/24, the router's end .1, the region's .2
CHANNEL_PORT = 7443  # the home's channel
RELAY_PORT = 7443  # the relay's, in the router namespace, on every region's gateway address
LOCK = f"/tmp/{PREFIX}-wan.lock"
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wan_relay.py")
CLONE_NEWNET = 0x40000000
SIOCETHTOOL = 0x8946
ETHTOOL_OFF = (0x1F, 0x24, 0x2C)  # ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO
MTU_FRAME = 1514


@dataclass(frozen=True)
class Site:
    """One region: its namespace, its link's two ends and addresses."""

    name: str
    index: int

    @property
    def netns(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def host_end(self) -> str:
        """The router's end of the region's link (the end whose counters are read)."""
        return f"{PREFIX}{self.index}r"

    @property
    def ns_end(self) -> str:
        return f"{PREFIX}{self.index}n"

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{self.index}.2"

    @property
    def gateway(self) -> str:
        return f"{SUBNET}.{self.index}.1"


def burst_bytes(rate_mbit: float) -> int:
    """tbf's bucket: 10 full frames, or 1 ms at the rate when that is more."""
    return max(10 * MTU_FRAME, int(rate_mbit * 1e6 / 8 / 1000))


class RegionNet:
    """Region namespaces joined by shaped links to a router that relays only the channel.

    Args:
        names: the regions, the home first.
    """

    def __init__(self, names: list[str]):
        self.sites = [Site(name, i) for i, name in enumerate(names)]
        self.rate_mbit: float | None = None
        self.delay_ms: float | None = None
        self.temp = ""
        self.holder: subprocess.Popen | None = None  # a process in the router namespace: its /proc view
        self.relay: subprocess.Popen | None = None

    @property
    def home(self) -> Site:
        return self.sites[0]

    @property
    def regions(self) -> list[Site]:
        """The sites whose links are counted (wan.py's ``CounterLog`` reads ``regions[1:]``)."""
        return self.sites

    def __enter__(self) -> "RegionNet":
        self._lock = open(LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"another regions rehearsal holds {LOCK}; wait for it to finish") from None
        self._old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
        self._old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.close()  # what an earlier, killed run may have left
            self.temp = tempfile.mkdtemp(prefix=f"{PREFIX}ray", dir="/tmp")  # short: Ray's socket paths
            self._build()
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
            self._lock.close()

    # ---- links ------------------------------------------------------------------------
    def _build(self) -> None:
        sh("ip", "netns", "add", ROUTER)
        sh("ip", "-n", ROUTER, "link", "set", "lo", "up")
        # No IP forwarding: the relay on the channel's port is the only way between regions.
        sh("ip", "netns", "exec", ROUTER, "sysctl", "-qw", "net.ipv4.ip_forward=0")
        for s in self.sites:
            sh("ip", "netns", "add", s.netns)
            sh(
                "ip",
                "link",
                "add",
                s.host_end,
                "netns",
                ROUTER,
                "type",
                "veth",
                "peer",
                "name",
                s.ns_end,
                "netns",
                s.netns,
            )
            sh("ip", "-n", ROUTER, "addr", "add", f"{s.gateway}/24", "dev", s.host_end)
            sh("ip", "-n", ROUTER, "link", "set", s.host_end, "up")
            sh("ip", "-n", s.netns, "addr", "add", f"{s.ip}/24", "dev", s.ns_end)
            sh("ip", "-n", s.netns, "link", "set", s.ns_end, "up")
            sh("ip", "-n", s.netns, "link", "set", "lo", "up")
            # A default route so Ray finds the region's own address (it asks the kernel
            # which source address would reach the internet); the router forwards nothing.
            sh("ip", "-n", s.netns, "route", "add", "default", "via", s.gateway)
            offloads_off(ROUTER, s.host_end)
            offloads_off(s.netns, s.ns_end)
        self.holder = subprocess.Popen(["ip", "netns", "exec", ROUTER, "sleep", "infinity"])

    def shape(self, rate_mbit: float) -> None:
        """Every link, both directions, to ``rate_mbit`` Mbit/s (tbf: rate, no delay)."""
        spec = ("root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst_bytes(rate_mbit)), "latency", "200ms")
        for s in self.sites:
            sh("ip", "netns", "exec", ROUTER, "tc", "qdisc", "replace", "dev", s.host_end, *spec)
            sh("ip", "netns", "exec", s.netns, "tc", "qdisc", "replace", "dev", s.ns_end, *spec)
        self.rate_mbit = rate_mbit

    def set_delay(self, delay_ms: float) -> None:
        """(Re)start the relay with ``delay_ms`` one way (each direction)."""
        self._stop_relay()
        cmd = [sys.executable, RELAY, "--listen", f"0.0.0.0:{RELAY_PORT}"]
        cmd += ["--to", f"{self.home.ip}:{CHANNEL_PORT}", "--delay-ms", str(delay_ms)]
        path = os.path.join(self.temp, f"relay-{delay_ms:g}ms-{time.monotonic_ns()}.log")
        with open(path, "w") as log:
            self.relay = subprocess.Popen(["ip", "netns", "exec", ROUTER, *cmd], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while "listening" not in open(path).read():
            if self.relay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not start: {open(path).read()}")
            time.sleep(0.1)
        self.delay_ms = delay_ms

    def _stop_relay(self) -> None:
        if self.relay is not None and self.relay.poll() is None:
            self.relay.terminate()
            try:
                self.relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait()
        self.relay = None

    def link(self, site: Site, up: bool) -> None:
        """Take ``site``'s link down (an outage: frames dropped both ways) or back up."""
        sh("ip", "-n", ROUTER, "link", "set", site.host_end, "up" if up else "down")

    def counters(self) -> dict[str, dict[str, int]]:
        """Non-home region -> bytes (``up``, ``down``) and packets (``up_packets``,
        ``down_packets``) it has sent and received so far, from its link's router end."""
        with open(f"/proc/{self.holder.pid}/net/dev") as f:
            rows = {line.split(":")[0].strip(): line.split(":")[1].split() for line in f.readlines()[2:]}
        out = {}
        for s in self.sites[1:]:
            v = [int(x) for x in rows[s.host_end]]  # rx: bytes packets ...; tx from the 9th field
            out[s.name] = {"up": v[0], "up_packets": v[1], "down": v[8], "down_packets": v[9]}
        return out

    def in_router(self):
        """This thread in the router's network namespace (sockets made here live there)."""
        return in_netns(ROUTER)

    # ---- processes -----------------------------------------------------------------------
    def env(self, **extra: str) -> dict:
        """A process's environment: a private Ray of its own, its files under this net's temp dir."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**base, "RAY_ADDRESS": "local", "RAY_TMPDIR": self.temp, "HF_HUB_OFFLINE": "1", **extra}

    def start(self, site: Site, cmd: list[str], log_path: str, env: dict) -> subprocess.Popen:
        """``cmd`` in ``site``'s namespace, its output to ``log_path``."""
        return subprocess.Popen(
            ["ip", "netns", "exec", site.netns, *cmd],
            env=env,
            stdout=open(log_path, "w"),
            stderr=subprocess.STDOUT,
            text=True,
        )

    def processes(self, site: Site) -> dict[int, str]:
        """pid -> the first 60 characters of its command line, every process in ``site``'s namespace."""
        out = {}
        for pid in sh("ip", "netns", "pids", site.netns, check=False).split():
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    out[int(pid)] = f.read().replace("\0", " ")[:60]
            except OSError:
                pass
        return out

    def stop_processes(self) -> None:
        """Stop every process in the regions' namespaces (the relay and holder stay)."""
        _kill([p for s in self.sites for p in sh("ip", "netns", "pids", s.netns, check=False).split()])

    # ---- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process this net started and remove its namespaces and links."""
        names = [n.split()[0] for n in sh("ip", "netns", "list", check=False).splitlines() if n.strip()]
        ours = [n for n in names if n.startswith(f"{PREFIX}-")]
        _kill([p for n in ours for p in sh("ip", "netns", "pids", n, check=False).split()])
        for proc in (self.relay, self.holder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.relay = self.holder = None
        for n in ours:  # a namespace's veth ends go with it
            sh("ip", "netns", "del", n, check=False)
        if self.temp:
            _kill(sh("pgrep", "-f", self.temp, check=False).split())
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = ""


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


def leftovers() -> list[str]:
    """Namespaces and links of this module still on the machine."""
    names = [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines() if line.strip()]
    found = [f"netns {n}" for n in names if n.startswith(f"{PREFIX}-")]
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(PREFIX):
            found.append(f"link {link}")
    return found
