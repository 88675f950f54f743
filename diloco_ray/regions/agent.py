"""A region's agent: ``diloco-ray region`` joins the home over the channel and runs the
region's replicas on the region's own Ray cluster, one sync at a time.

:class:`RegionAgent` dials out to the home (:class:`~diloco_ray.channel.client.ChannelClient`)
and takes the job's config from it, so a region cannot drift from the home's. It then
starts the region's replicas (:class:`~diloco_ray.regions.replicas.RegionReplicas`, on this
cluster), and for every job notice:

1. applies the notice to the region's books (:class:`~diloco_ray.regions.books.RegionBooks`:
   the verdicts on its earlier messages, a re-run's rewind, the home's restore directive, a
   replica rejected as non-finite starting fresh), then runs one sync period on every
   replica with its share of the region's data plan, handing them the weights messages
   through the region's :class:`~diloco_ray.regions.mailbox.Mailbox` as it downloads them
   (and the full weights when a replica must load everything: its first period, a gap, a
   restore, a reset); with overlap the replicas start before the download, which rides
   under their steps;
2. collects the period as the home collects its own (a frozen, dead or late replica is
   dropped and its slot refilled), merges what the replicas sent into one message per home
   server and uploads it with one stats summary, which hands back every range no merged
   replica trained. The books are saved in the region's ``output_dir`` first, so an agent
   restarted into the same run takes them up.

When the home checkpoints, it asks the region between periods for its part (its replicas'
inner state and its residual, in its own ``output_dir``) and keeps what the region answers.

With overlap, a round's next period is known before its notice comes: the home sends it
ahead with the last one (:attr:`~diloco_ray.regions.wire.Notice.ahead`), and the replicas
start it as soon as they end a period, while the agent merges and uploads, so neither the
reply's crossing nor the notice's holds them up. The notice, when it comes, is the one expected and the period
goes on; any other (the region dropped, the round run again, the home restarted) stops it
first, as a period the home stops.

Inside the region the replicas' own leg is uncompressed; the run's codec applies to what
crosses the channel. A link that breaks is retried with backoff by the client: the region
keeps its replicas and their state, and takes up the next job when the home is back.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from diloco_ray.channel.client import ChannelClient, ChannelRefused
from diloco_ray.channel.headers import MAX_WAIT_S
from diloco_ray.config.fault_plan import for_region
from diloco_ray.config.region_rules import regions_take_the_step
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.control import ray_connection
from diloco_ray.control.ray_session import RaySession
from diloco_ray.errors import first_line
from diloco_ray.logs import log
from diloco_ray.regions import notices, wire
from diloco_ray.regions.books import PeriodStart, RegionBooks
from diloco_ray.regions.mailbox import FullWeightsOf, Mailbox, full_key
from diloco_ray.regions.merge import RegionalMerge
from diloco_ray.regions.mirror import Behind, Diverged, ServerMirror
from diloco_ray.regions.notices import Abort, HomeNotice, SaveRequest, Stop
from diloco_ray.regions.replicas import RegionReplicas, job_for
from diloco_ray.runtime.messages import Contribution, RegionFacts, RoundStats

MAILBOX_THREADS = 64  # takes waiting at once: every rank's messages of a period, and full weights


@dataclass
class Ahead:
    """A period the replicas started before its notice came: the notice expected, the
    replicas' launches, and their data plans."""

    notice: wire.Notice
    launched: dict
    plans: dict


def in_region_config(home: dict, region: dict, output_dir: str) -> TrainerConfig:
    """The region's own view of the home's job: its replica count, no regions of its own,
    an uncompressed leg inside the region, the faults the home's plan aims at its replicas
    (none of the home's own), no checkpoints of the home's, and its own ``output_dir``."""
    overrides = dict(
        num_replicas=int(region["replicas"]),
        min_replicas=1,
        min_quorum=1,  # the home's quorum counts regions; inside, the agent runs every replica each period
        max_replicas=None,
        spare_replicas=0,
        regions=None,
        channel_tls_cert=None,
        channel_tls_key=None,
        region_holdout_margin=None,  # the home tries what a region sends; a region has no regions
        region_downlink="weights",  # (what crosses to the region is the home's choice)
        pseudo_grad_compression="none",
        error_feedback=False,
        error_feedback_decay=None,
        topk_fraction=None,
        fault_plan=for_region(home.get("fault_plan"), region["name"]),
        checkpoint_steps=None,
        resume_from=None,
        link_mbps=None,
        log_with=None,
        output_dir=output_dir,
        overwrite_output_dir=True,
    )
    return TrainerConfig.from_dict({**home, **overrides})


class RegionAgent:
    """One region's side of a run.

    Args:
        client: the region's channel client (not yet joined).
        output_dir: the region's own folder (its logs, its books and its part of the
            home's checkpoints; the run's outputs are the home's).
        log_line: where the agent's one-line notes go.
        give_up_after_s: how long the home may be unreachable before the agent leaves
            (:class:`~diloco_ray.channel.client.ChannelDown`); None: never.
    """

    def __init__(
        self,
        client: ChannelClient,
        output_dir: str,
        log_line: Callable[[str], None] = log.info,
        give_up_after_s: Optional[float] = None,
    ):
        self.client, self.output_dir, self.log = client, output_dir, log_line
        self.give_up_after_s = give_up_after_s
        self.replicas: Optional[RegionReplicas] = None
        self.mailbox = None
        self.ray = RaySession(lambda: ray_connection.connect_region(self.log))
        self.stopping = threading.Event()
        self.ahead: Optional[Ahead] = None  # with overlap: the next period, started before its notice

    def run(self) -> int:
        """Connect to this region's Ray, join, start the replicas, and run every job the
        home hands out until it says the run is over. Returns the syncs this region took
        part in. Ray comes first: a region that cannot start it never joins the round."""
        self.ray.open()
        self.log(f"region {self.client.region!r}: Ray is up; joining the home at {self.client.address}")
        info = self.client.join()
        home, region = info["config"], info["region"]
        os.makedirs(self.output_dir, exist_ok=True)
        self.config = in_region_config(home, region, self.output_dir)
        self.log(f"region {region['name']!r}: joined; {region['replicas']} replicas")
        self._start_beating(float(home.get("channel_timeout_s") or 20.0))
        run = f"{home.get('output_dir')}|{home.get('seed')}|{region['name']}"  # what a saved state must match
        self._start(TrainerConfig.from_dict(home), run)
        self.client.ready = True  # the next beat tells the home: jobs may come from now on
        self.client.beat(timeout_s=10.0)
        try:
            return self._serve(region["name"])
        finally:
            self.close()

    def _serve(self, name: str) -> int:
        """Run every job the home hands out until it says the run is over; the syncs run."""
        synced, self.seq, self.inbox = 0, 0, []
        while True:
            notice = self._next_notice()
            if notice is None:
                continue
            if self.ahead is not None and notice != self.ahead.notice:
                self._drop_ahead()  # the home went another way (a save comes between rounds: its round is over)
            if isinstance(notice, SaveRequest):
                self._save_checkpoint(notice)
                continue
            if isinstance(notice, Abort):
                continue  # (a period told to stop has already ended here: they run one at a time)
            if isinstance(notice, Stop):
                self.log(f"region {name!r}: the home says the run is over")
                return synced
            try:
                self._sync(notice)
            except ChannelRefused as stale:
                if "is published" not in str(stale):
                    raise
                # The home moved on while this region was behind: the next job brings it up.
                self.log(f"region {name!r}: skipped a job the home has moved past ({stale})")
                self._decline(notice)
                continue
            synced += 1

    def _next_notice(self) -> Optional[HomeNotice]:
        """The next notice to act on. Everything the home has queued is read first, so a
        job it has already told this region to drop (a region back from an outage finds
        its old job and that job's abort waiting) is passed over, not run: only the
        verdicts it carries are settled (the home tells each verdict once)."""
        if not self.inbox:
            self.seq, notice = self.client.wait(self.seq, give_up_after_s=self.give_up_after_s)
            self.inbox += [notices.from_wire(notice)] if notice is not None else []
            while notice is not None:
                self.seq, notice = self.client.wait(self.seq, wait_s=0.0, give_up_after_s=self.give_up_after_s)
                self.inbox += [notices.from_wire(notice)] if notice is not None else []
        if not self.inbox:
            return None
        notice = self.inbox.pop(0)
        dropped = {n.attempt for n in self.inbox if isinstance(n, Abort)}
        if isinstance(notice, wire.Notice) and notice.period.attempt in dropped:
            self.log(f"region: passed over job {notice.period.attempt}, which the home has dropped")
            self.books.settle(notice.verdicts)
            if self.ahead is not None and self.ahead.notice == notice:
                self._drop_ahead()
            return None
        return notice

    def _start_beating(self, timeout_s: float) -> None:
        """Beat five times per ``channel_timeout_s`` from a thread of its own, so the home
        can tell a region busy training from one whose link is down."""
        every = timeout_s / 5

        def beat() -> None:
            while not self.stopping.wait(every):
                self.client.beat(timeout_s=every)

        threading.Thread(target=beat, name="region-beat", daemon=True).start()

    def _start(self, home: TrainerConfig, run: str) -> None:
        import ray

        from diloco_ray.control import ray_connection
        from diloco_ray.runtime.rank import RankWorker
        from diloco_ray.runtime.replica import Replica, start_token_data

        s = self.config.sections()
        device = ray_connection.resolve_device(s.placement.device)
        token_data = start_token_data(s.data, s.model)
        sizes = [s.data.sequences_for(i) for i in range(s.membership.num_replicas)]  # each slot's share of a plan
        self.replicas = RegionReplicas(
            lambda rid: Replica(rid, self.config, device, RankWorker, token_data),
            *(sizes, s.membership, s.sync_codec, s.run.sync_mode, self.log),
        )
        servers = s.placement.num_param_servers
        # region_downlink: step: the region's copy of the home's servers takes every sync itself.
        self.copy = ServerMirror(home.to_dict()) if regions_take_the_step(home.sections()) else None
        self.copy_differed = False  # its digest differed at the last sync (told to the home once)
        self.mailbox = ray.remote(Mailbox).options(num_cpus=0, max_concurrency=MAILBOX_THREADS).remote()
        self.servers = [FullWeightsOf(self.mailbox, i) for i in range(servers)]
        self.overlap = s.sync_codec.overlap_communication
        merge = RegionalMerge(self.replicas.shapes, home.sections().sync_codec, servers)
        keep = s.checkpointing.save_total_limit
        self.books = RegionBooks(merge, self.output_dir, run, s.membership.restore_on_retry, keep)
        taken = self.books.load()
        if taken:
            self.log(f"region: {taken}")

    def _sync(self, notice: wire.Notice) -> None:
        """One sync period of every replica, merged into the region's one reply (the
        period started ahead of this notice, when it is the one expected)."""
        full = list(notice.full_keys)
        start = self.books.begin(notice, self.replicas.ids)
        if start.note:
            self.log(f"region: {start.note}")
        if start.restore_from is not None:
            self.replicas.load_inner_state(start.restore_from)
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # the run loop dropped it unless this is its notice
            launch, launched, plans = None, ahead.launched, ahead.plans
        else:
            # With overlap the replicas merge this period's message at its end: they start now
            # and the download rides under their steps. Else, and for a full load, it comes first.
            early = self.overlap and not (notice.full or notice.reset or full or start.reload)
            launch, plans = self._launcher(notice, start)
            launched = launch() if early else None
        try:
            self._deliver(notice)
        except ChannelRefused:  # the home moved past this job: the replicas started on it stop
            self._stop(notice.period.attempt, launched or {})
            raise
        self._reply(notice, launched if launched is not None else launch(), plans)

    def _launcher(self, notice: wire.Notice, start: PeriodStart) -> tuple[Callable[[], dict], dict]:
        """How to launch ``notice``'s period on every replica (the takes of its messages
        made, what the last period held void), and the replicas' data plans."""
        import ray

        keys = list(notice.messages)
        ray.get(self.mailbox.keep.remote(keys))  # the last period's messages and full weights are void
        messages = [self.mailbox.take.remote(key) for key in keys]
        plans = self.replicas.plans(notice.plan)
        board = self.replicas.board

        def launch() -> dict:
            jobs = {rid: job_for(notice, rid, plans[rid], messages, self.servers, start, board=board) for rid in plans}
            return self.replicas.launch(jobs)

        return launch, plans

    def _start_ahead(self, notice: wire.Notice) -> None:
        """With overlap, start the round's next period on the replicas now (they have just
        ended ``notice``'s): the home sent it ahead, as it will hand it if the round goes on
        as planned."""
        expected = notice.ahead if self.overlap else None
        if expected is None:
            return
        launch, plans = self._launcher(expected, PeriodStart())
        self.ahead = Ahead(expected, launch(), plans)

    def _drop_ahead(self) -> None:
        """Stop the period started ahead: its notice will not come."""
        ahead, self.ahead = self.ahead, None
        self.log(f"region: stopped job {ahead.notice.period.attempt}, started ahead: the home went another way")
        self._stop(ahead.notice.period.attempt, ahead.launched)

    def _stop(self, attempt: int, launched: dict) -> None:
        """Stop the replicas' period of launch ``attempt``, letting go of a replica that
        waits for one of its messages."""
        self.mailbox.keep.remote([])
        self.replicas.stop_period(attempt, launched)

    def _decline(self, notice: wire.Notice) -> None:
        """Answer a job this region did not run, so the home does not wait for it: nothing
        merged, and its whole plan handed back to the cursor."""
        plan = list(notice.plan)
        declined = RoundStats.empty(aborted=True, unused=plan, region=RegionFacts(**self._copy_facts()))
        empty = [np.zeros(0, dtype=np.uint8)] * len(self.servers)
        self.client.upload(notice.reply, wire.reply_payload(empty, declined), give_up_after_s=self.give_up_after_s)

    def _deliver(self, notice: wire.Notice) -> None:
        """Put the period's messages (and the full weights, when sent: the replicas may need
        to load everything) into the mailbox, where the replicas take them: made by the
        region's copy of the servers when it reaches the period's weights, else downloaded."""
        made = self._from_copy(notice) if self.copy is not None else None
        if made is not None:
            messages, full = made
        else:
            messages = [self._download(key) for key in notice.messages]
            full = [self._download(key) for key in notice.full_keys]
        for key, message in zip(notice.messages, messages):
            self.mailbox.put.remote(key, message)
        for index, weights in enumerate(full):
            self.mailbox.put.remote(full_key(index), weights)

    def _from_copy(self, notice: wire.Notice) -> Optional[tuple[list, list]]:
        """The period's messages (and the full weights when asked for) made by the region's
        copy of the servers, brought to the notice's weights by what the home sent for it;
        None where it cannot get there (they are downloaded)."""
        copy, download = self.copy, self._download
        try:
            made = copy.catch_up([download(k) for k in notice.states], map(download, notice.records), notice.version)
        except Diverged as e:
            self.copy_differed = True
            self.log(f"region: {e}; downloading, and the home sends the whole state")
            return None
        except Behind as e:
            self.log(f"region: {e}: downloading")
            return None
        if notice.states:
            self.log(f"region: took up the home's servers' whole state at version {notice.version}")
        full = copy.full_weights() if notice.full_keys else []
        if notice.full:
            return copy.full_weights(), full
        return (made if made is not None else copy.last_weights()), full

    def _copy_facts(self) -> dict:
        """What the region's replies say of its copy of the servers (the differed flag once)."""
        version = -1 if self.copy is None or self.copy.version is None else self.copy.version
        differed, self.copy_differed = self.copy_differed, False
        return {"copy_version": version, "copy_differed": differed}

    def _reply(self, notice: wire.Notice, launched: dict, plans: dict) -> None:
        """Collect the replicas' periods, merge them into one message and upload it; then
        refill the slots of replicas that were dropped (their successors load everything
        next period, so the reply asks for the full weights)."""
        poll = self.replicas.collect(launched, notice.period.attempt)
        stats = poll.reported
        if len(stats) == len(launched):
            self._start_ahead(notice)  # the replicas go on while their sends are merged and cross
        servers = len(self.servers)
        weights = {rid: float(sum(s.loss_tokens for s in stats[rid])) for rid in stats}
        contributions = [
            [Contribution(rid, launched[rid].buffers[s], weights[rid]) for rid in stats] for s in range(servers)
        ]
        message = self.books.merge_period(notice.period.fragment, contributions, notice.period.attempt)
        summary = wire.summarize(stats, plans, message.accepted, message.weight)
        # What the home publishes for this region next: a refilled slot loads everything at once,
        # a replica rejected as non-finite at its next round's start.
        reload = {"reload": bool(self.replicas.lost), "reload_at_round": self.books.resets_at_round_start}
        summary = replace(summary, region=replace(summary.region, **reload, **self._copy_facts()))
        out = message.buffers or [np.zeros(0, dtype=np.uint8)] * servers
        self.books.save()  # before the upload: what it carries is in the books
        self.client.upload(notice.reply, wire.reply_payload(out, summary), give_up_after_s=self.give_up_after_s)
        self.replicas.refill()

    def _save_checkpoint(self, request: SaveRequest) -> None:
        """The region's part of the home's checkpoint: its replicas' inner state and its
        residual, with the verdicts the home has not delivered yet settled first; the home
        keeps the answer (an id and a digest) to name it on a restore."""
        self.books.settle(dict(request.verdicts))
        tmp = self.books.begin_checkpoint(request.round)
        try:
            self.replicas.save_inner_state(tmp)
        except Exception as e:  # a replica lost or frozen: no part this time (a restore starts the region fresh)
            self.log(f"region: could not save its part of checkpoint {request.round} ({first_line(e)})")
            return
        saved = self.books.commit_checkpoint(tmp, request.round)
        self.client.upload(request.reply, wire.saved_payload(saved), give_up_after_s=self.give_up_after_s)
        self.log(f"region: saved its part of checkpoint {request.round}")

    def _download(self, key: str) -> np.ndarray:
        """A message the home published or is about to (its servers may still be making it)."""
        data = self.client.download(key, give_up_after_s=self.give_up_after_s, wait_s=MAX_WAIT_S)
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        """Stop the replicas (and this cluster's Ray, when the agent started it)."""
        self.stopping.set()
        if self.replicas is not None:
            self.replicas.close()
        self.ray.close()
        self.client.close()
