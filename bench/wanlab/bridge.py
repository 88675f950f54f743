"""The flat layout: one Ray cluster over namespaces joined by real rate-limited links (``bench/wan.py``).

Each region is a Linux network namespace joined to one bridge by a veth pair. Both
directions of each pair are shaped with ``tc`` ``tbf`` to the region's rate: the root end's
egress is what flows *into* the region (down), the namespace end's egress what flows *out*
(up). ``netem`` is not available here, so links have a rate but no added delay. A Ray head
runs in the servers' region and one raylet in each replica's region, each advertising a
custom resource named after its region, so ``server_resources`` / ``replica_resources`` pin
actors to regions and every byte between them crosses two shaped links. Every region's Ray
listens on the same fixed ports, so a frame's port tells which service it is for
(:data:`SERVICES`: Ray's control plane, workers' calls, object transfers).

Bytes are read from the root ends' interface counters (``/sys/class/net/*/statistics``):
``rx`` there is what the region sent, ``tx`` what it received. Everything built is torn
down by :meth:`BridgedCluster.close` (namespaces and their processes, the bridge, this
cluster's Ray processes and temp dir) on any exit of ``with`` (:class:`wanlab.netns.Lab`).
Needs root and ``ip``/``tc``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from .netns import Lab, Site, kill, namespaces, pids_in, sh, shape

PREFIX = "dlw"  # every namespace, link and bridge this module makes starts with it
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.213.7"
HEAD_PORT = 6397
# Every region's Ray listens on the same fixed ports (each region has its own addresses),
# so a frame's port says which service the connection is to (:data:`SERVICES`).
NODE_MANAGER_PORT, OBJECT_MANAGER_PORT, METRICS_PORT = 6380, 6381, 6382
AGENT_GRPC_PORT, AGENT_HTTP_PORT, RUNTIME_ENV_AGENT_PORT = 6383, 6384, 6385
WORKER_PORTS = (10002, 19999)  # Ray's default range: drivers' and workers' gRPC servers
# Listening port -> which service: the GCS, the raylets and their agents carry no message
# (Ray's control plane), workers' servers carry actor calls with their inlined arguments
# and replies, object managers carry objects too large to inline.
SERVICES = {
    HEAD_PORT: "gcs",
    NODE_MANAGER_PORT: "raylet",
    METRICS_PORT: "agent",
    AGENT_GRPC_PORT: "agent",
    AGENT_HTTP_PORT: "agent",
    RUNTIME_ENV_AGENT_PORT: "agent",
    OBJECT_MANAGER_PORT: "objects",
    **{port: "worker" for port in range(WORKER_PORTS[0], WORKER_PORTS[1] + 1)},
}
# Ray pulls an object again (from its first byte) when it is not local 10 s after the pull
# began (RAY_object_manager_pull_timeout_ms): a 10.9 MB message to two replicas over a
# 5 Mbit/s link takes 35 s, so every such transfer crossed the link twice (measured:
# wire/reported down 1.98). Slow links need a timeout above their longest transfer.
PULL_TIMEOUT_MS = 300_000


class BridgedCluster(Lab):
    """A Ray cluster of regions joined through one bridge by shaped links; a context manager.

    Args:
        replicas: replica regions to make (``r0``, ``r1``, ...), besides ``srv``.
        cpus: logical CPUs each replica region's raylet advertises.
        head_cpus: logical CPUs of the head (servers and driver region).
    """

    prefix = PREFIX

    def __init__(self, replicas: int, cpus: float = 2, head_cpus: float = 2):
        names = ["srv"] + [f"r{i}" for i in range(replicas)]
        self.regions = [Site(name, i, PREFIX, f"{SUBNET}.{10 + i}") for i, name in enumerate(names)]
        self.cpus, self.head_cpus = cpus, head_cpus
        self.temp = ""
        self.rate_mbit: float | None = None

    @property
    def head(self) -> Site:
        return self.regions[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{HEAD_PORT}"

    def build(self) -> None:
        self._build_links()
        self._start_ray()

    # ---- links ------------------------------------------------------------------------
    def _build_links(self) -> None:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for r in self.regions:
            sh("ip", "netns", "add", r.netns)
            sh("ip", "link", "add", r.host_end, "type", "veth", "peer", "name", r.ns_end)
            sh("ip", "link", "set", r.ns_end, "netns", r.netns)
            sh("ip", "link", "set", r.host_end, "master", BRIDGE)
            sh("ip", "link", "set", r.host_end, "up")
            inside = ("ip", "netns", "exec", r.netns)
            sh(*inside, "ip", "addr", "add", f"{r.ip}/24", "dev", r.ns_end)
            sh(*inside, "ip", "link", "set", r.ns_end, "up")
            sh(*inside, "ip", "link", "set", "lo", "up")

    def shape(self, rate_mbit: float) -> None:
        """Every link, both directions, to ``rate_mbit`` Mbit/s (tbf: rate, no delay)."""
        burst = max(16_000, int(rate_mbit * 1e6 / 8 / 100))  # >= 10 ms of traffic
        for r in self.regions:
            shape(r, rate_mbit, burst)
        self.rate_mbit = rate_mbit

    def counters(self) -> dict[str, dict[str, int]]:
        """Region name -> bytes (``up``, ``down``) and packets (``up_packets``,
        ``down_packets``) it has sent and received so far."""
        # The root end's rx is what the region sent, its tx what the region received.
        names = {"up": "rx_bytes", "down": "tx_bytes", "up_packets": "rx_packets", "down_packets": "tx_packets"}
        return {
            r.name: {key: _read_int(f"/sys/class/net/{r.host_end}/statistics/{name}") for key, name in names.items()}
            for r in self.regions
        }

    # ---- Ray -----------------------------------------------------------------------------
    def in_region(self, region: Site, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", region.netns, *cmd]

    def env(self) -> dict:
        """The environment of a process that talks to this cluster (Ray's token, address)."""
        return {**os.environ, "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}

    def _start_ray(self) -> None:
        self.temp = tempfile.mkdtemp(prefix=f"{PREFIX}ray", dir="/tmp")  # short: Ray's socket paths
        env = {**self.env(), "RAY_object_manager_pull_timeout_ms": str(PULL_TIMEOUT_MS)}
        if env["RAY_AUTH_MODE"] == "token" and not (env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH")):
            subprocess.run(["ray", "get-auth-token", "--generate"], env=env, capture_output=True, check=True)
        common = ["--disable-usage-stats", "--object-store-memory", "200000000"]
        common += [
            *("--node-manager-port", str(NODE_MANAGER_PORT), "--object-manager-port", str(OBJECT_MANAGER_PORT)),
            *("--metrics-export-port", str(METRICS_PORT), "--dashboard-agent-grpc-port", str(AGENT_GRPC_PORT)),
            *("--dashboard-agent-listen-port", str(AGENT_HTTP_PORT)),
            *("--runtime-env-agent-port", str(RUNTIME_ENV_AGENT_PORT)),
            *("--min-worker-port", str(WORKER_PORTS[0]), "--max-worker-port", str(WORKER_PORTS[1])),
        ]
        head = ["--head", "--port", str(HEAD_PORT), "--include-dashboard", "false", "--num-cpus", str(self.head_cpus)]
        node = ["--address", self.address, "--num-cpus", str(self.cpus)]
        # The head first (the raylets join its GCS), then every replica's raylet at once.
        for batch in ([self.head], self.regions[1:]):
            starts = [(r, self._ray_start(r, *(head if r is self.head else node), *common, env=env)) for r in batch]
            for r, proc in starts:
                _, err = proc.communicate()
                if proc.returncode:
                    raise RuntimeError(f"ray start in {r.netns} failed: {err.strip()[-2000:]}")

    def _ray_start(self, region: Site, *args: str, env: dict) -> subprocess.Popen:
        """``ray start`` in ``region``, its node's address and region resource added."""
        resources = json.dumps({region.resource: 1})
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--node-ip-address", region.ip]
        # A temp dir of its own: raylets starting at once in one temp dir race on its files.
        cmd += ["--temp-dir", os.path.join(self.temp, region.name)]
        return subprocess.Popen(
            self.in_region(region, *cmd, "--resources", resources),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, *cmd: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the head's region against this cluster, as a user's driver runs."""
        return subprocess.run(
            self.in_region(self.head, *cmd), env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    # ---- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop this cluster's processes and remove every namespace and link it made."""
        # Every region's processes at once: one wait for them all, not one per region.
        pids = [p for r in self.regions for p in pids_in(r.netns)]
        if self.temp:
            pids += sh("pgrep", "-f", self.temp, check=False).split()
        kill(pids)
        if self.temp:
            shutil.rmtree(self.temp, ignore_errors=True)
        kill([p.split()[0] for p in sh("pgrep", "-af", f"/tmp/{PREFIX}ray", check=False).splitlines()])
        for r in self.regions:
            sh("ip", "netns", "del", r.netns, check=False)
            sh("ip", "link", "del", r.host_end, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)
        for name in namespaces(PREFIX):
            sh("ip", "netns", "del", name, check=False)


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())
