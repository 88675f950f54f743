"""The driver's handle on the parameter-server actors.

:class:`ServerGroup` starts ``num_param_servers`` :class:`~diloco_ray.runtime.server.ParameterServer`
actors (each placed with its own ``server_resources``), and turns "sync this fragment"
into the chain prepare -> reduce -> commit -> weights on every server. Ray resolves the
chain's arguments between the actors, so :meth:`ServerGroup.sync` returns at once with
references: the driver waits only where it needs an answer, and with
``overlap_communication`` the replicas keep training meanwhile. The server class is made
remote here, at creation, so tests can pass a subclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import ray

from diloco_ray.algo import compression
from diloco_ray.config.region_rules import regions_take_the_step
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.runtime import warm_actors
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server import ParameterServer

PING_TIMEOUT_S = 30.0  # a live server answers a ping at once, whatever it is doing


@dataclass
class SyncRefs:
    """The references one sync leaves behind.

    Args:
        commits: one ``AppliedRound`` ref per server (server 0's is the one reported).
        weights: one packed weights-message ref per server, for the replicas.
        digests: one ref per server to the digest of its rows after the sync
            (:meth:`~diloco_ray.runtime.server.ParameterServer.weights_digest`), when asked for.
        fragment, contributions, merge: what the sync was handed (a region repeating it
            needs them: :mod:`diloco_ray.regions.records`).
    """

    commits: list
    weights: list
    digests: list = dataclasses.field(default_factory=list)
    fragment: int = 0
    contributions: list = dataclasses.field(default_factory=list)
    merge: Optional[tuple] = None


def remote_call(actor, method: str, *args, **kwargs):
    """``actor.method.remote(*args, **kwargs)``: a server call of :func:`chain_sync` on an actor."""
    return getattr(actor, method).remote(*args, **kwargs)


def chain_sync(
    servers: list,
    call: Callable,
    fragment: int,
    contributions: list[list[Contribution]],
    plans: dict,
    unused: Optional[dict] = None,
    merge: Optional[tuple] = None,
    scale: Optional[float] = None,
    digest: bool = False,
) -> SyncRefs:
    """One sync of ``fragment`` on every server, in the order every copy of the servers
    takes it: prepare, reduce, commit, then the weights message (and, with ``digest``, the
    digest of the weights it leaves). ``call(server, method, *args, **kwargs)`` makes each call: on actors
    (:func:`remote_call`, Ray chains them and this returns refs at once) or on servers held
    in this process (a region's copy of the home's: :mod:`diloco_ray.regions.mirror`).
    ``scale``: what the weights are divided by before the sum (None: the
    :func:`~diloco_ray.algo.aggregate.weight_scale` of these contributions' weights)."""
    divisor, shares = merge if merge is not None else (None, None)
    prepared = [call(a, "prepare", fragment, contributions[s], divisor, scale) for s, a in enumerate(servers)]
    reduced = [call(a, "reduce", *prepared) for a in servers]
    commits = [call(a, "commit", plans, *reduced, unused=unused, shares=shares) for a in servers]
    weights = [call(a, "new_weights_message", fragment) for a in servers]
    digests = [call(a, "weights_digest") for a in servers] if digest else []
    return SyncRefs(commits, weights, digests, fragment, contributions, merge)


class ServerGroup:
    """Starts and drives the parameter-server actors.

    Args:
        config: the job's TrainerConfig, shipped to every server (as a dict); the group
            itself reads its placement section.
        server_cls: the server class (``ParameterServer``; tests may pass a subclass).
    """

    def __init__(self, config: TrainerConfig, server_cls: type = ParameterServer):
        sections = config.sections()
        placement = sections.placement
        count = placement.num_param_servers
        resources = placement.server_resources
        per_server = resources if isinstance(resources, list) else [resources] * count
        # "control": a liveness question answered beside a sync in progress (see ping).
        remote_cls = ray.remote(concurrency_groups={"control": 1})(server_cls)
        # A GPU only when asked for (server_gpus): Ray then shows the server that one GPU.
        gpus = {"num_gpus": placement.server_gpus} if placement.server_gpus else {}
        job = config.to_dict()
        # Regions that take the outer step themselves check every sync by the servers' digests.
        self.digest = bool(sections.channel.regions) and regions_take_the_step(sections)
        self.on_sync: Optional[Callable[[SyncRefs], None]] = None  # told of every sync chained
        self.actors, self.keys = [], []
        for s in range(count):
            resources = per_server[s] or None
            shape = (placement.server_cpus, tuple(sorted((resources or {}).items())), placement.server_gpus)
            key = (server_cls, *shape)

            def reset(actors: list, s: int = s) -> list:
                return [a.reset.remote(job, s) for a in actors]

            # A kept server of this shape first (runtime.warm_actors).
            kept = warm_actors.take(key, reset)
            if kept is None:
                options = dict(num_cpus=placement.server_cpus, resources=resources, name=None, **gpus)
                kept = warm_actors.Kept(key, [remote_cls.options(**options).remote(job, s)])
            self.actors += kept.actors
            self.keys.append(key)

    def __len__(self) -> int:
        return len(self.actors)

    # ---- state ---------------------------------------------------------------------------
    def initialize(self, per_server_refs: list[list], shapes: dict) -> None:
        """Seed every server from one replica's ranks."""
        ray.get([a.initialize.remote(per_server_refs[s], shapes) for s, a in enumerate(self.actors)])

    def load(self, path: str) -> None:
        """Restore every server from checkpoint ``path``."""
        ray.get([a.load.remote(path) for a in self.actors])

    def save(self, folder: str) -> list:
        return [a.save.remote(folder) for a in self.actors]

    def round_index(self) -> int:
        return ray.get(self.actors[0].round_index.remote())

    def ping(self, timeout_s: float = PING_TIMEOUT_S) -> bool:
        """Whether every server is alive: a dead one raises ``RayActorError``. Answered in
        the servers' control group, not behind a sync they are working on; one that does
        not answer within ``timeout_s`` is taken as alive (busy, not dead). Returns whether
        every server answered (False: taken as alive on the timeout)."""
        refs = [a.alive.options(concurrency_group="control").remote() for a in self.actors]
        try:
            ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return False
        return True

    def version(self) -> int:
        return ray.get(self.actors[0].sync_version.remote())

    def work(self) -> float:
        """Decoupled mode: rounds' worth of tokens merged so far."""
        return ray.get(self.actors[0].merged_work.remote())

    def data_plan(self, replica_ids: list[int]) -> list:
        """Server 0 holds the data cursor."""
        return ray.get(self.actors[0].data_plan.remote(replica_ids))

    def reserve_plan(self, replica_id: int) -> list:
        """Decoupled mode: the next plan for one replica, taken off every server's cursor."""
        return ray.get([a.reserve_plan.remote(replica_id) for a in self.actors])[0]

    def release_plan(self, replica_id: int) -> None:
        """Decoupled mode: give a lost replica's in-flight plan back."""
        ray.get([a.release_plan.remote(replica_id) for a in self.actors])

    # ---- traffic -------------------------------------------------------------------------
    def sync(
        self,
        fragment: int,
        contributions: list[list[Contribution]],
        plans: dict,
        unused: Optional[dict] = None,
        merge: Optional[tuple] = None,
    ) -> SyncRefs:
        """Chain one sync of ``fragment`` on every server and return at once.

        Args:
            fragment: the fragment being synced (0 for plain DiLoCo).
            contributions: per server, the replicas' contributions to it.
            plans: replica id -> stream ranges, for the cursor at the round's end.
            unused: replica id -> the ranges of its plan it did not train on (``inner_time_s``).
            merge: decoupled mode: (divisor, shares): one round's worth of tokens, and
                replica id -> its contribution's share of it.
        """
        refs = chain_sync(self.actors, remote_call, fragment, contributions, plans, unused, merge, digest=self.digest)
        if self.on_sync is not None:
            self.on_sync(refs)
        return refs

    def full_weights(self) -> list:
        """Refs to what replicas hold, every parameter (for a replica starting out)."""
        return [a.full_weights.remote() for a in self.actors]

    def last_weights(self) -> list:
        """Refs to the latest sync's weights message (what replicas merge next)."""
        return [a.last_weights.remote() for a in self.actors]

    def global_weights(self) -> list:
        """Refs to the exact fp32 global weights, packed per server (eval, final/)."""
        return [a.global_weights.remote() for a in self.actors]

    def trial_weights(self, contributions: list[Contribution]) -> list:
        """Refs to the global weights minus one contribution (``contributions``: its part
        for each server), packed per server."""
        return [a.trial_weights.remote(c) for a, c in zip(self.actors, contributions)]

    def tensor(self, name: str, shape) -> np.ndarray:
        """The full fp32 values of one parameter, gathered from the servers holding it."""
        from diloco_ray.persist.final_save import assemble_rows

        slices = [r for r in ray.get([a.rows_of.remote(name) for a in self.actors]) if r is not None]
        return assemble_rows(name, shape, slices)

    def kill(self, keep: bool = False) -> None:
        """Kill the servers; ``keep``: keep them for the next run instead, where they can be
        (runtime.warm_actors)."""
        for a, key in zip(self.actors, self.keys):
            if not (keep and warm_actors.keep(key, [a])):
                warm_actors.Kept(key, [a]).kill()


def assemble_weights(buffers: list, shapes: dict) -> dict[str, np.ndarray]:
    """Full fp32 arrays from every server's packed slice (for inspection and tests)."""
    from diloco_ray.algo import partition

    out = {n: np.empty(s, dtype=np.float32) for n, s in shapes.items()}
    for buf in buffers:
        pieces, _ = compression.unpack_pieces(buf, list(shapes))
        for name, (start, piece) in pieces.items():
            rows = partition.num_rows(piece.shape)
            partition.put(out[name], (start, start + rows), piece.numpy())
    return out
