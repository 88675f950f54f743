"""One DiLoCo replica as the driver sees it: a placement group and its rank actors.

A :class:`Replica` reserves one placement group for its ``ranks_per_replica`` ranks, on one
node (STRICT_PACK, so its FSDP ranks share a fast interconnect) or evenly over
``nodes_per_replica`` nodes (:func:`~diloco_ray.runtime.placement.replica_layout`), starts one
:class:`~diloco_ray.runtime.rank.RankWorker` actor per rank, hands each the GPUs it sees and
where the ranks meet, and turns "run a round" into one call per rank. It returns object
references, never values: the driver decides what to wait for, and the big arrays go from the
ranks to the server through the object store. The worker class is made remote here, at
creation, so tests can pass a fake.
"""

from __future__ import annotations

import uuid

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import DataSection, ModelSection
from diloco_ray.data import samples, sources
from diloco_ray.runtime import warm_actors
from diloco_ray.runtime.messages import SyncPeriod
from diloco_ray.runtime.placement import place_ranks, replica_layout
from diloco_ray.runtime.rank import RankWorker


def start_token_data(data: DataSection, model: ModelSection) -> list | None:
    """Start the job's one tokenising task; ``[ref]`` to its TokenData, which every rank
    of every replica (later ones too) reads, or None with ``streaming`` (ranks read the
    stream themselves).

    Tokenising once instead of on every rank saves each rank importing ``datasets`` and
    tokenising (which takes minutes on a large corpus) and keeps one copy of the samples
    per node instead of one per rank. It asks for no CPU, so a cluster whose
    CPUs the replicas reserve still runs it, and ends its worker process after it
    (``max_calls=1``), so what tokenising held goes back to the node. A ``builtin:`` data
    set is tokenised here, on the driver, instead.
    """
    if data.streaming:
        return None
    if sources.is_builtin(data):
        # Generated and small, so quicker here than in a task, which would first start a
        # worker process that imports datasets and transformers.
        return [ray.put(samples.prepare_token_data(data, model))]
    task = ray.remote(num_cpus=0, max_calls=1)(samples.prepare_token_data)
    return [task.remote(data, model)]


def resources_for_replica(resources, replica_id: int) -> dict:
    """The custom resources (``replica_resources``) each rank bundle of replica
    ``replica_id`` asks for: the mapping, or entry ``id mod len`` of a list."""
    if isinstance(resources, list):
        return dict(resources[replica_id % len(resources)])
    return dict(resources or {})


class Replica:
    """Handle for one replica's placement group and rank actors.

    Args:
        replica_id: stable id (never reused within a run).
        config: the job's TrainerConfig, shipped to each rank as its own view
            (:meth:`~diloco_ray.config.schema.TrainerConfig.for_replica`); the replica itself
            reads its placement and membership sections.
        device: ``"cpu"`` or ``"cuda"`` (one GPU per rank; the ranks on a node see all of the
            replica's GPUs there and each binds its own).
        worker_cls: the rank class to run (``RankWorker``; tests may pass a fake).
        token_data: :func:`start_token_data`'s ``[ref]``, handed to every rank's set-up
            (None: each rank tokenises).
    """

    # A replica's ranks beat on the step board: one silent for stall_timeout_s is frozen.
    judged_by_steps = True

    def __init__(
        self,
        replica_id: int,
        config: TrainerConfig,
        device: str,
        worker_cls: type = RankWorker,
        token_data: list | None = None,
    ):
        sections = config.sections()
        self.id = replica_id
        self.placement, self.membership = sections.placement, sections.membership
        self.world_size = self.placement.ranks_of(replica_id)
        self.token_data = token_data
        bundle: dict[str, float] = {"CPU": self.placement.cpus_per_rank}
        if device == "cuda":
            bundle["GPU"] = 1
        bundle.update(resources_for_replica(self.placement.replica_resources, replica_id))
        self.bundle = bundle  # one rank's share
        self.shapes: dict[str, tuple] = {}  # trained parameter shapes, known after setup
        self.setup_refs: list | None = None  # set once set-up has been started
        self.nodes: list[str] = []  # each rank's Ray node id, known once set-up has been started
        self.requested_at = 0.0
        own = config.for_replica(replica_id).to_dict()
        rank_args = [(own, replica_id, r, self.world_size, device) for r in range(self.world_size)]

        def reset(ranks: list) -> list:
            return [rank.reset.remote(*args) for rank, args in zip(ranks, rank_args)]

        # Kept actors of this shape are taken first, with their placement group (runtime.warm_actors).
        shape = (tuple(sorted(bundle.items())), self.world_size, self.placement.nodes_per_replica, device)
        self.key = (worker_cls, *shape)
        kept = warm_actors.take(self.key, reset)
        if kept is not None:
            self.pg, self.ranks = kept.pg, kept.actors
        else:
            self._start(bundle, worker_cls, device, rank_args)
        self.placed_ref = self.pg.ready()

    def _start(self, bundle: dict, worker_cls: type, device: str, rank_args: list) -> None:
        """Reserve the placement group and start one new actor per rank."""
        layout = replica_layout(bundle, self.world_size, self.placement.nodes_per_replica)
        self.pg = placement_group(
            layout.bundles,
            strategy=layout.strategy,
            # Unique: a group whose removal (asynchronous) lags, or a crashed trainer's, must not
            # refuse the next trainer's in the same job (names are unique per Ray namespace).
            name=f"diloco-replica-{self.id}-{uuid.uuid4().hex[:8]}",
        )
        # "control" lets abort() reach a rank while run_period() is busy; "messages" lets a
        # period's messages leave while the next period runs; every other call stays in the
        # default group and runs in order.
        remote_cls = ray.remote(concurrency_groups={"control": 1, "messages": 1})(worker_cls)
        self.ranks = [
            remote_cls.options(
                num_cpus=self.placement.cpus_per_rank,
                num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=layout.bundle_of_rank[r]
                ),
            ).remote(*rank_args[r])
            for r in range(self.world_size)
        ]

    def pending_refs(self) -> list:
        """What this replica's start is waiting on: placement, then the ranks' set-up."""
        return [self.placed_ref] if self.setup_refs is None else list(self.setup_refs)

    def setup(self) -> list:
        """Start the ranks' set-up (devices, process group, model, FSDP, data); refs to their
        parameter shapes.

        First each rank says where it runs (node, Ray's GPU ids), before anything in it touches
        CUDA, and rank 0 where the ranks meet; then each is handed its
        :class:`~diloco_ray.runtime.placement.RankPlacement` with that meeting point."""
        refs = [r.where.remote() for r in self.ranks]
        if self.world_size > 1:
            refs.append(self.ranks[0].rendezvous.remote(self.placement.nodes_per_replica > 1))
        answers = ray.get(refs, timeout=self.membership.call_timeout_s)
        init_method = answers[-1] if self.world_size > 1 else None
        placed = place_ranks(answers[: self.world_size])
        self.nodes = [p.node_id for p in placed]
        return [r.setup.remote(init_method, self.token_data, p) for r, p in zip(self.ranks, placed)]

    def seed_pieces(self) -> list[list]:
        """Per server, refs to each rank's rows of the freshly built weights."""
        servers = self.placement.num_param_servers
        return per_server([r.seed_pieces.options(num_returns=servers).remote() for r in self.ranks], servers)

    def adopt_initial(self, expected: list | None) -> list:
        """Refs to each rank's (digests, adopted) of its freshly built weights, given the
        seeding replica's per-rank digests (None: only report them)."""
        return [r.adopt_initial.remote(None if expected is None else expected[i]) for i, r in enumerate(self.ranks)]

    def run_period(self, job: SyncPeriod) -> tuple[list[list], list]:
        """Start one sync period on every rank: (per server, the ranks' pseudo-gradient
        buffer refs; the ranks' stats refs). The stats come as soon as the messages are on
        their way to the host; the messages by their own call, which waits for the copy
        (while the next period runs, with overlap: rank_outbox)."""
        servers = self.placement.num_param_servers
        stats = [r.run_period.remote(job) for r in self.ranks]
        group = "messages"
        sends = [
            r.message.options(num_returns=servers, concurrency_group=group).remote(job.period.attempt)
            for r in self.ranks
        ]
        return per_server(sends, servers), stats

    def abort(self, attempt: int) -> None:
        """Tell every rank to stop the sync period of launch ``attempt`` at its next step
        (fire and forget)."""
        for r in self.ranks:
            r.abort.options(concurrency_group="control").remote(attempt)

    def save_inner_state(self, folder: str, slot: int, sent_verdicts: tuple = ()) -> list:
        return [r.save_inner_state.remote(folder, slot, sent_verdicts) for r in self.ranks]

    def load_inner_state(self, folder: str, slot: int) -> list:
        return [r.load_inner_state.remote(folder, slot) for r in self.ranks]

    def evaluate(self, weight_refs: list) -> list:
        """Eval of the global weights (one ref per server) on every rank."""
        return [r.evaluate.remote(weight_refs) for r in self.ranks]

    def save_final(self, weight_refs: list, path: str, merged_path: str | None = None) -> list:
        return [r.save_final.remote(weight_refs, path, merged_path) for r in self.ranks]

    def stop(self, keep: bool = False) -> None:
        """Kill the rank actors and release the placement group (idempotent); ``keep``: keep
        them for the next run instead, where they can be (runtime.warm_actors)."""
        if not (keep and self.ranks and warm_actors.keep(self.key, self.ranks, self.pg)):
            warm_actors.Kept(self.key, self.ranks, self.pg).kill()
        self.ranks = []


def per_server(refs: list, servers: int) -> list[list]:
    """Per server, the ranks' refs, from each rank's ``num_returns=servers`` call (a bare
    ref when ``servers`` is 1)."""
    refs = [[ref] if servers == 1 else ref for ref in refs]
    return [[per_rank[s] for per_rank in refs] for s in range(servers)]
