"""The regions layout: separate Ray clusters over shaped links, joined only by the channel (``bench/wan.py --regions``).

:class:`RegionNet` builds one network namespace per region (``home``, the first, runs the
driver, the servers, its own replicas and the channel's port; every other region runs
``diloco-ray region`` on a private Ray cluster of its own) and one router namespace. Each
region is joined to the router by a veth pair on a subnet of its own, shaped with ``tc tbf``
in both directions (the router end's egress is what flows into the region, down; the
region end's egress what flows out, up). The router does not forward IP: the only way
across is the delaying relay (:mod:`wanlab.relay`) it runs on the channel's port, which every
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
namespaces and their links, the Ray temp dir) on any exit of ``with``
(:class:`wanlab.netns.Lab`). The prefix differs from :mod:`wanlab.bridge`'s, and so does
the lock, so the two cannot collide. Needs root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from .netns import Lab, Site, in_netns, kill, namespaces, offloads_off, pids_in, sh, shape

PREFIX = "dlr"  # every namespace and link this module makes starts with it (the bridge's: "dlw")
ROUTER = f"{PREFIX}-router"
SUBNET = "10.214"  # region i's link: 10.214.i.0/24, the router's end .1, the region's .2
CHANNEL_PORT = 7443  # the home's channel
RELAY_PORT = 7443  # the relay's, in the router namespace, on every region's gateway address
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py")
MTU_FRAME = 1514


def burst_bytes(rate_mbit: float) -> int:
    """tbf's bucket: 10 full frames, or 1 ms at the rate when that is more."""
    return max(10 * MTU_FRAME, int(rate_mbit * 1e6 / 8 / 1000))


class RegionNet(Lab):
    """Region namespaces joined by shaped links to a router that relays only the channel.

    Args:
        names: the regions, the home first.
    """

    prefix = PREFIX

    def __init__(self, names: list[str]):
        self.sites = [Site(n, i, PREFIX, f"{SUBNET}.{i}.2", gateway=f"{SUBNET}.{i}.1") for i, n in enumerate(names)]
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
        """The sites whose links are counted (``CounterLog`` reads ``regions[1:]``)."""
        return self.sites

    def build(self) -> None:
        self.temp = tempfile.mkdtemp(prefix=f"{PREFIX}ray", dir="/tmp")  # short: Ray's socket paths
        self._build_links()

    # ---- links ------------------------------------------------------------------------
    def _build_links(self) -> None:
        sh("ip", "netns", "add", ROUTER)
        sh("ip", "-n", ROUTER, "link", "set", "lo", "up")
        # No IP forwarding: the relay on the channel's port is the only way between regions.
        sh("ip", "netns", "exec", ROUTER, "sysctl", "-qw", "net.ipv4.ip_forward=0")
        for s in self.sites:
            sh("ip", "netns", "add", s.netns)
            veth = ("type", "veth", "peer", "name", s.ns_end, "netns", s.netns)
            sh("ip", "link", "add", s.host_end, "netns", ROUTER, *veth)
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
        for s in self.sites:
            shape(s, rate_mbit, burst_bytes(rate_mbit), router=ROUTER)
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
        for pid in pids_in(site.netns):
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    out[int(pid)] = f.read().replace("\0", " ")[:60]
            except OSError:
                pass
        return out

    def stop_processes(self) -> None:
        """Stop every process in the regions' namespaces (the relay and holder stay)."""
        kill([p for s in self.sites for p in pids_in(s.netns)])

    # ---- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process this net started and remove its namespaces and links."""
        ours = namespaces(PREFIX)
        kill([p for n in ours for p in pids_in(n)])
        for proc in (self.relay, self.holder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.relay = self.holder = None
        for n in ours:  # a namespace's veth ends go with it
            sh("ip", "netns", "del", n, check=False)
        if self.temp:
            kill(sh("pgrep", "-f", self.temp, check=False).split())
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = ""
