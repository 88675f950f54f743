"""What crosses the channel for one sync, and how a region shares it among its replicas.

The home hands a region one job per sync period, as a *notice* (:class:`Notice`, a small
JSON object: its period (:class:`~diloco_ray.runtime.messages.PeriodId`: the round, fragment
and launch attempt), the region's data plan, which weights
version to load and under which keys the channel holds those messages), and the region
answers with one *reply*
(its merged pseudo-gradient, one buffer per home server, and one summary of its replicas'
stats). Actor handles and object refs never cross: each side turns a notice into its own
:class:`~diloco_ray.runtime.messages.SyncPeriod` with refs into its own object store.

The channel keys of a period's messages and reply follow one rule (:func:`message_keys`,
:func:`reply_key`, the latter named by the period's id), by which the home works out the round's next period
(:func:`next_in_round`) and sends it with each notice (``Notice.ahead``), so that with
overlap a region starts its replicas on it before its notice comes. Every key
names the home's run (``home``, one per start of the home: a resumed home counts its
launches and versions from its checkpoint again), so an upload or a download of the last
home's that crosses late is never taken for one of the new home's.

Inside the region, :func:`split_plan` cuts the region's plan into its replicas' plans in
slot order, exactly as the home's cursor cuts a round among replicas (returned ranges
first, each replica its own contiguous share), so a region of ``n`` replicas trains the
positions ``n`` consecutive flat replicas would. :func:`summarize` folds the replicas'
stats into the one the home's records and cursor read: the tokens of the replicas
merged and their period's steps (as one replica's: they ran side by side), and every
range not trained into an applied pseudo-gradient (a replica rejected, late or lost
inside the region) handed back as unused, so it goes back to the home's cursor and
exactly-once data holds across regions.

Pure functions over plain values; no Ray, no sockets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from diloco_ray.channel import frames
from diloco_ray.data.plan import take_from
from diloco_ray.runtime.messages import PeriodId, RegionFacts, RoundStats, SyncPeriod

Range = tuple[int, int]


@dataclass(frozen=True)
class Notice:
    """One sync period of a region as the home hands it over the channel: the job's own
    fields (its period id, the region's data plan, the weights version
    and the flags), under which keys the channel holds the weights messages (``messages``,
    one per home server, and the full weights ``full_keys`` for a load after a gap), where
    the region uploads its reply, the home's restore directive (what the region's state
    starts from in this home's run: its id, carried out once, and the region's saved part of
    the checkpoint the servers started from, or None), and the home's run (``home``) that
    the keys name.

    ``ahead``: the round's next period as the home will hand it when the round goes on as
    planned (:func:`next_in_round`; None for a round's last period), so that with overlap a
    region starts it before its notice comes. The home works it out, by its own counters; a
    notice that then differs from it means the home went another way. It is not part of the
    period: two notices of one period are equal whatever they expect next.
    """

    period: PeriodId
    full: bool
    version: int
    plan: tuple[Range, ...]
    messages: tuple[str, ...]
    reply: str
    home: str
    full_keys: tuple[str, ...] = ()
    reset: bool = False
    restart: bool = False
    reset_inner: bool = False
    schedule_step: Optional[int] = None
    time_budget_s: Optional[float] = None
    sent_verdicts: tuple[tuple[int, bool], ...] = ()
    restore: Mapping = dataclasses.field(default_factory=dict)
    # region_downlink: step: how the region's copy of the servers reaches this period's weights
    # (how, not which period: not compared). The channel keys of the home's syncs' records,
    # oldest first, and of each server's whole state, when sent.
    records: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    states: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    ahead: Optional[Notice] = dataclasses.field(default=None, compare=False)

    @property
    def verdicts(self) -> dict[int, bool]:
        """The home's verdicts on the region's earlier sends, by launch attempt."""
        return dict(self.sent_verdicts)

    def to_wire(self) -> dict:
        """The notice as the JSON object that crosses the channel."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("ahead", "period")}
        out.update(dataclasses.asdict(self.period))
        out.update(plan=[list(r) for r in self.plan], sent_verdicts=[list(v) for v in self.sent_verdicts])
        out.update(messages=list(self.messages), full_keys=list(self.full_keys), restore=dict(self.restore))
        out.update(records=list(self.records), states=list(self.states))
        out["ahead"] = None if self.ahead is None else self.ahead.to_wire()
        return out

    @classmethod
    def from_wire(cls, data: Mapping) -> Notice:
        """The notice the home sent (:meth:`to_wire`), each field as its type."""
        ahead = data.get("ahead")
        return cls(
            period=PeriodId(int(data["round"]), int(data["fragment"]), int(data["attempt"])),
            version=int(data["version"]),
            **{name: bool(data.get(name, False)) for name in ("full", "reset", "restart", "reset_inner")},
            plan=tuple((int(s), int(c)) for s, c in data["plan"]),
            messages=tuple(str(k) for k in data["messages"]),
            reply=str(data["reply"]),
            home=str(data["home"]),
            full_keys=tuple(str(k) for k in data.get("full_keys", ())),
            schedule_step=None if data.get("schedule_step") is None else int(data["schedule_step"]),
            time_budget_s=None if data.get("time_budget_s") is None else float(data["time_budget_s"]),
            sent_verdicts=tuple((int(a), bool(ok)) for a, ok in data.get("sent_verdicts", ())),
            restore=dict(data.get("restore") or {}),
            records=tuple(str(k) for k in data.get("records", ())),
            states=tuple(str(k) for k in data.get("states", ())),
            ahead=None if ahead is None else cls.from_wire(ahead),
        )

    def job(self, plan: Sequence[Range], messages: Sequence, servers: Sequence, **extra) -> SyncPeriod:
        """A replica's :class:`SyncPeriod` inside the region: its own ``plan``
        (:func:`split_plan`), the weights ``messages`` as refs in the region's store, the
        region's ``servers`` for a full load; ``extra``: the region's own fields (its step
        board, and flags of its own beside the home's: a reload, a replica's fresh start)."""
        fields = {name: getattr(self, name) for name in PERIOD_FIELDS}
        fields.update(plan=[(int(s), int(c)) for s, c in plan], messages=list(messages), servers=list(servers))
        return SyncPeriod(**{**fields, "sent_verdicts": self.sent_verdicts, **extra})


# The SyncPeriod fields a notice carries as they are.
PERIOD_FIELDS = ("period", "full", "version", "reset", "restart", "reset_inner")
PERIOD_FIELDS += ("schedule_step", "time_budget_s")


def notice_of(
    job: SyncPeriod,
    message_keys: Sequence[str],
    full_keys: Sequence[str],
    reply_key: str,
    restore: Mapping,
    home: str,
    fragments: int,
    region: str,
) -> Notice:
    """The notice of ``job`` for ``region`` (see :class:`Notice`), with the round's next
    period ahead of it (a round of ``fragments`` sync periods)."""
    notice = Notice(
        **{name: getattr(job, name) for name in PERIOD_FIELDS},
        plan=tuple((int(s), int(c)) for s, c in job.plan),
        messages=tuple(message_keys),
        reply=reply_key,
        home=home,
        full_keys=tuple(full_keys),
        sent_verdicts=tuple((int(a), bool(ok)) for a, ok in job.sent_verdicts),
        restore=dict(restore),
    )
    return dataclasses.replace(notice, ahead=next_in_round(notice, region, fragments))


def message_keys(home: str, version: int, servers: int, full: bool = False) -> list[str]:
    """The channel keys of weights ``version``'s messages in the home's run ``home``, one per
    home server (``full``: the full weights of that version, for a region that must load
    everything)."""
    return [f"{'f' if full else 'w'}/{home}/{version}/{s}" for s in range(servers)]


def reply_key(home: str, region: str, period: PeriodId) -> str:
    """Where ``region`` uploads its reply to ``period`` in ``home``'s run."""
    return f"r/{home}/{region}/{period.attempt}/{period.fragment}"


def next_in_round(notice: Notice, region: str, fragments: int) -> Optional[Notice]:
    """The notice the home sends ``region`` for the next sync period of ``notice``'s round
    when the round goes on as planned (None: ``notice`` is the round's last period).

    Inside a round the next period is the next launch (``attempt`` + 1) of the next
    fragment on the same data plan, handed the message of this period's sync (the next
    ``version``, never a full load), with nothing to reset and no verdicts yet (the
    servers' commits are read at the round's end).
    """
    this = notice.period
    if this.fragment + 1 >= fragments:
        return None
    period, version = PeriodId(this.round, this.fragment + 1, this.attempt + 1), notice.version + 1
    return dataclasses.replace(
        notice,
        period=period,
        version=version,
        full=False,
        reset=False,
        restart=False,
        reset_inner=False,
        sent_verdicts=(),
        messages=tuple(message_keys(notice.home, version, len(notice.messages))),
        full_keys=(),
        reply=reply_key(notice.home, region, period),
        records=(),
        states=(),
        ahead=None,
    )


def needs_full(job: SyncPeriod, held: Optional[int]) -> bool:
    """Whether a region's replicas may ask for the full weights in ``job``'s period, having
    last completed a period at version ``held`` (None: none yet, or not known to have): not
    when the messages are the full weights, nor when they bring the version after ``held``
    and nothing asks for a reload (a restore, a NaN reset)."""
    if job.full:
        return False
    return held is None or job.version > held + 1 or job.reset or job.reset_inner


def split_plan(plan: Sequence[Range], sizes: Sequence[int]) -> list[list[Range]]:
    """``plan`` cut into consecutive shares of ``sizes`` positions, in order (replica slot
    ``i`` of the region gets ``sizes[i]``); the shares partition the plan."""
    if sum(sizes) != sum(c for _, c in plan):
        raise ValueError(f"a plan of {sum(c for _, c in plan)} positions cannot be cut into {list(sizes)}")
    left = [(int(s), int(c)) for s, c in plan]
    return [take_from(left, size)[0] for size in sizes]


def summarize(
    stats: Mapping[int, Sequence[RoundStats]],
    plans: Mapping[int, Sequence[Range]],
    merged: Iterable[int],
    weight: float,
) -> RoundStats:
    """The one stats object a region reports for a sync: the merged replicas' (``merged``)
    tokens and losses summed over their ranks, their period's steps (the most any ran),
    ``weight`` (the tokens of its message) as its loss tokens, the bytes of every replica,
    and as unused every range that reached no merged pseudo-gradient: the unused ranges of
    merged replicas and the whole plans of the others (``plans``: every replica's share,
    reported or not)."""
    merged = [rid for rid in merged if rid in stats]
    ok = [s for rid in merged for s in stats[rid]]
    every = [s for ranks in stats.values() for s in ranks]
    unused: list[Range] = []
    for rid, plan in plans.items():
        unused += [tuple(r) for r in (stats[rid][0].unused if rid in merged else plan)]
    return RoundStats(
        rank=0,
        inner_steps=max((s.inner_steps for s in ok), default=0),  # its replicas run side by side
        tokens=sum(s.tokens for s in ok),
        loss_sum=float(sum(s.loss_sum for s in ok)),
        compute_seconds=max((s.compute_seconds for s in every), default=0.0),
        load_seconds=max((s.load_seconds for s in every), default=0.0),
        bytes_up=sum(s.bytes_up for s in every),
        bytes_down=sum(s.bytes_down for s in every),
        aborted=not merged,
        restarted=any(s.restarted for s in every),
        loss_tokens=int(round(weight)),
        unused=sorted(unused),
        region=RegionFacts(replica_ids=tuple(sorted(merged))),
    )


def reply_payload(buffers: Sequence[np.ndarray], summary: RoundStats) -> bytes:
    """A region's reply as one checked frame: the summary and the buffers' sizes in the
    header, the buffers one after another as its payload."""
    stats = {**dataclasses.asdict(summary), "region": summary.region.claims() if summary.region else None}
    header = {"stats": stats, "sizes": [int(len(b)) for b in buffers]}
    return frames.encode(header, b"".join(np.asarray(b, dtype=np.uint8).tobytes() for b in buffers))


def saved_payload(saved: Mapping) -> bytes:
    """A region's answer to a checkpoint's save request: what the home keeps of its part."""
    return frames.encode({"saved": dict(saved)}, b"")


def saved_of(payload: bytes, max_bytes: int, round_index: int) -> dict:
    """A region's answer to the save request of checkpoint ``round_index``, checked: an id,
    that round, and a hex digest, nothing else.

    Raises:
        frames.BadFrame: anything else.
    """
    saved = frames.decode(payload, max_bytes).header.get("saved")
    if not isinstance(saved, dict) or set(saved) != {"id", "round", "digest"}:
        raise frames.BadFrame("malformed: a save's answer is {id, round, digest}")
    ok = isinstance(saved["id"], str) and len(saved["id"]) <= 64 and saved["id"].isalnum()
    ok = ok and isinstance(saved["digest"], str) and len(saved["digest"]) == 64
    ok = ok and all(c in "0123456789abcdef" for c in saved["digest"])
    if not ok or saved["round"] != round_index or isinstance(saved["round"], bool):
        raise frames.BadFrame(f"malformed: a save's answer for round {round_index} names another or a bad id")
    return saved


def reply_of(payload: bytes, max_bytes: int) -> tuple[list[np.ndarray], RoundStats]:
    """The buffers and summary of a reply (:func:`reply_payload`), checked as a frame: a
    summary of :class:`RoundStats`' fields and buffers that fill the payload exactly.

    Raises:
        frames.BadFrame: anything else.
    """
    frame = frames.decode(payload, max_bytes)
    try:
        stats = dict(frame.header["stats"])
        stats["unused"] = [tuple(r) for r in stats.get("unused", [])]
        sizes = [int(size) for size in frame.header["sizes"]]
        region = stats.pop("region", None)
        summary = RoundStats(**stats)
    except (KeyError, TypeError, ValueError):
        raise frames.BadFrame("malformed: a reply is {stats: the fields of RoundStats, sizes: [bytes, ...]}") from None
    summary = dataclasses.replace(summary, region=facts_of(region))
    buffers, at = [], 0
    for size in sizes:
        if size < 0 or at + size > len(frame.payload):
            break
        buffers.append(np.frombuffer(frame.payload, dtype=np.uint8, count=size, offset=at).copy())
        at += size
    if at != len(frame.payload) or len(buffers) != len(sizes):
        raise frames.BadFrame(
            f"malformed: the buffers' sizes do not add up to the payload's {len(frame.payload)} bytes"
        )
    return buffers, summary


COUNTS = ("rank", "inner_steps", "tokens", "bytes_up", "bytes_down", "loss_tokens", "resumed_step")
AMOUNTS = ("loss_sum", "compute_seconds", "load_seconds")


def refused_claim(stats: RoundStats, plan: Sequence[Range], seq_len: int) -> Optional[str]:
    """Why a region's summary claims what the home did not plan for it (None: it does not):
    a count that is not a whole number from 0, an amount that is not finite from 0, more
    tokens (its weight in the mean) or steps than its ``plan`` holds sequences of
    ``seq_len``, unused ranges that are not inside its plan or overlap, or facts the home
    does not read."""
    positions = sum(int(c) for _, c in plan)
    why = _bad_numbers(stats)
    if why is None and max(stats.tokens, stats.loss_tokens) > positions * seq_len:
        why = f"{max(stats.tokens, stats.loss_tokens)} tokens claimed; its plan holds {positions * seq_len}"
    if why is None and stats.inner_steps > positions:
        why = f"{stats.inner_steps} steps claimed on a plan of {positions} sequences"
    return why or _outside(stats.unused, plan)


def facts_of(claims) -> RegionFacts:
    """A region's facts from what it sent: only the claims the home reads, each of its type.

    Raises:
        frames.BadFrame: anything else.
    """
    known = RegionFacts.CLAIMS
    ok = isinstance(claims, dict) and not set(claims) - set(known)
    ok = ok and all(isinstance(claims.get(k, t()), t) for k, t in known.items())
    ok = ok and type(claims.get("copy_version", -1)) is int and claims.get("copy_version", -1) >= -1
    if not ok or not all(type(i) is int for i in claims.get("replica_ids", [])):
        raise frames.BadFrame(f"malformed: its facts are not {{{', '.join(known)}}} of their types")
    return RegionFacts(**{**claims, "replica_ids": tuple(claims.get("replica_ids", []))})


def _bad_numbers(stats: RoundStats) -> Optional[str]:
    for name in COUNTS:
        value = getattr(stats, name)
        if type(value) is not int or value < 0:
            return f"{name} {value!r} is not a count"
    for name in AMOUNTS:
        value = getattr(stats, name)
        if type(value) not in (int, float) or not np.isfinite(value) or value < 0:
            return f"{name} {value!r} is not a finite amount from 0"
    return None


def _outside(unused: Sequence, plan: Sequence[Range]) -> Optional[str]:
    """Why ``unused`` is not a set of disjoint ranges inside ``plan`` (None: it is)."""
    spans = []
    for r in unused:
        if len(r) != 2 or not all(type(v) is int for v in r) or r[0] < 0 or r[1] <= 0:
            return f"an unused range {list(r)!r} is not (start, count)"
        if not any(s <= r[0] and r[0] + r[1] <= s + c for s, c in plan):
            return f"the unused range {list(r)!r} is not in its plan"
        spans.append((r[0], r[0] + r[1]))
    spans.sort()
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return "its unused ranges overlap"
    return None
