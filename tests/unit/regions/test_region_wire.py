"""What crosses the channel for a sync, and how a region shares its plan and reports back."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from diloco_ray.channel import frames
from diloco_ray.data import plan as data
from diloco_ray.regions import wire
from diloco_ray.runtime.messages import PeriodId, RegionFacts, RoundStats, SyncPeriod


@pytest.mark.parametrize("returned", [[], [(3, 5), (40, 2)], [(0, 100)]])
def test_a_region_of_n_replicas_trains_the_positions_of_n_consecutive_flat_replicas(returned):
    """The home cuts a round among 3 regions of 2 as among 6 flat replicas, returned ranges
    included: each region's plan, split among its replicas, is the two flat plans."""
    cursor = data.DataCursor(frontier=200, returned=returned)
    flat = data.plan_round(cursor, [12] * 6)
    regional = data.plan_round(cursor, [24] * 3)
    for r, plan in enumerate(regional):
        shares = wire.split_plan(plan, [12, 12])
        assert [data.plan_positions(s).tolist() for s in shares] == [
            data.plan_positions(flat[2 * r]).tolist(),
            data.plan_positions(flat[2 * r + 1]).tolist(),
        ]


def test_a_plan_that_does_not_fit_the_shares_is_refused():
    with pytest.raises(ValueError, match="cannot be cut"):
        wire.split_plan([(0, 10)], [4, 4])


def stats(rank=0, steps=5, tokens=100, loss=2.5, unused=()):
    return RoundStats(
        rank, steps, tokens, loss, 1.0, 0.5, 1000, bytes_down=2000, loss_tokens=tokens, unused=list(unused)
    )


def test_the_summary_counts_the_merged_replicas_and_hands_back_every_range_not_merged():
    plans = {0: [(0, 10)], 1: [(10, 10)], 2: [(20, 10)]}
    reported = {0: [stats(unused=[(8, 2)])], 1: [stats(tokens=80), stats(rank=1, tokens=80)]}  # 2 absent
    summary = wire.summarize(reported, plans, merged=[0, 1], weight=260.0)
    assert (summary.inner_steps, summary.tokens, summary.loss_tokens) == (
        5,
        260,
        260,
    )  # steps: one period, run side by side
    assert summary.loss_sum == pytest.approx(7.5) and summary.bytes_up == 3000
    assert summary.unused == [(8, 2), (20, 10)]  # 0's untrained tail, and all of absent 2's plan
    rejected = wire.summarize(reported, plans, merged=[0], weight=100.0)
    assert rejected.unused == [(8, 2), (10, 10), (20, 10)] and not rejected.aborted
    assert wire.summarize(reported, plans, merged=[], weight=0.0).aborted


def test_a_reply_round_trips_and_a_damaged_one_is_refused():
    buffers = [np.arange(10, dtype=np.uint8), np.zeros(0, dtype=np.uint8), np.full(3, 7, dtype=np.uint8)]
    summary = dataclasses.replace(stats(unused=[(4, 2)]), region=RegionFacts(replica_ids=(0, 1)))
    payload = wire.reply_payload(buffers, summary)
    got, back = wire.reply_of(payload, max_bytes=1 << 20)
    assert [b.tolist() for b in got] == [b.tolist() for b in buffers] and back == summary
    with pytest.raises(frames.BadFrame, match="corrupt"):
        wire.reply_of(payload[:-1] + bytes([payload[-1] ^ 1]), max_bytes=1 << 20)


def test_a_notice_carries_a_job_and_the_region_rebuilds_it_with_its_own_refs():
    job = SyncPeriod(
        period=PeriodId(3, 1, 9),
        plan=[(0, 24)],
        messages=["ref-a", "ref-b"],
        full=False,
        version=7,
        servers=["actor"],
        reset_inner=True,
        sent_verdicts=((8, True), (6, False)),
        schedule_step=90,
    )
    directive = {"id": "d1", "save": None}
    sent = wire.notice_of(job, ["w/7/0", "w/7/1"], ["f/7/0", "f/7/1"], "eu/a9/f1", directive, "h1", 2, "eu")
    notice = wire.Notice.from_wire(json.loads(json.dumps(sent.to_wire())))  # it crosses as JSON
    assert notice == sent and notice.messages == ("w/7/0", "w/7/1") and notice.reply == "eu/a9/f1"
    assert notice.ahead is None  # fragment 1 of 2: the round's last period
    share = wire.split_plan(notice.plan, [12, 12])[1]
    rebuilt = notice.job(share, ["local-a", "local-b"], ["regional"], board="board")
    assert (rebuilt.period, rebuilt.version) == (PeriodId(3, 1, 9), 7)
    assert rebuilt.plan == [(12, 12)] and rebuilt.messages == ["local-a", "local-b"]
    assert rebuilt.reset_inner and rebuilt.sent_verdicts == ((8, True), (6, False)) and rebuilt.schedule_step == 90
    assert rebuilt.servers == ["regional"] and rebuilt.board == "board" and not rebuilt.full


def test_the_full_weights_go_to_a_region_only_when_its_replicas_may_need_them():
    def job(version, full=False, **flags):
        return SyncPeriod(period=PeriodId(0, 0, 1), plan=[], messages=[], full=full, version=version, **flags)

    assert wire.needs_full(job(0), held=None)  # no period completed yet
    assert not wire.needs_full(job(5, full=True), held=None)  # the messages are the full weights
    assert not wire.needs_full(job(5), held=4) and not wire.needs_full(job(5), held=5)  # the next version, or a re-run
    assert wire.needs_full(job(7), held=4)  # a gap: it missed syncs
    assert wire.needs_full(job(5, reset=True), held=4) and wire.needs_full(job(5, reset_inner=True), held=4)


def test_a_resumed_homes_keys_never_meet_the_last_homes():
    """A resumed home counts its launches and versions from its checkpoint again: an upload
    of the last home's launch 4 that crosses late must not be taken for the new home's launch
    4, nor a download of its version 3 for the new version 3."""
    assert wire.reply_key("h1", "eu", PeriodId(0, 0, 4)) != wire.reply_key("h2", "eu", PeriodId(0, 0, 4))
    assert set(wire.message_keys("h1", 3, 2)).isdisjoint(wire.message_keys("h2", 3, 2))
    job = SyncPeriod(period=PeriodId(0, 0, 4), plan=[(0, 8)], messages=[], full=False, version=3)
    keys, reply = wire.message_keys("h2", 3, 1), wire.reply_key("h2", "eu", PeriodId(0, 0, 4))
    notice = wire.notice_of(job, keys, [], reply, {"id": "d1", "save": None}, "h2", 2, "eu")
    expected = notice.ahead  # the home works the round's next period out and sends it along
    assert expected.reply == wire.reply_key("h2", "eu", PeriodId(0, 1, 5))  # the next period's keys, in this home's run
    assert expected.messages == tuple(wire.message_keys("h2", 4, 1)) and expected.restore == notice.restore
    assert (expected.period, expected.version, expected.ahead) == (PeriodId(0, 1, 5), 4, None)
    # The notice the home then sends for that period is the one expected, whatever it expects next.
    job = dataclasses.replace(job, period=PeriodId(0, 1, 5), version=4)
    keys, reply = wire.message_keys("h2", 4, 1), wire.reply_key("h2", "eu", PeriodId(0, 1, 5))
    assert wire.notice_of(job, keys, [], reply, {"id": "d1", "save": None}, "h2", 3, "eu") == expected


PLAN = [(100, 4), (200, 2)]  # 6 sequences


@pytest.mark.parametrize(
    "claim, why",
    [
        (dict(unused=[(10**9, 500)]), r"the unused range \[1000000000, 500\] is not in its plan"),
        (dict(unused=[(100, 3), (102, 2)]), "its unused ranges overlap"),
        (dict(loss_tokens=10**12, tokens=10**12), "1000000000000 tokens claimed; its plan holds 48"),
        (dict(tokens=-1), "tokens -1 is not a count"),
        (dict(loss_sum=float("nan")), "loss_sum nan is not a finite amount"),
        (dict(inner_steps=7), "7 steps claimed on a plan of 6 sequences"),
        (dict(loss_tokens=True), "loss_tokens True is not a count"),
    ],
    ids=["cursor", "overlap", "weight", "negative", "nan", "steps", "bool"],
)
def test_a_region_s_claims_are_checked_against_its_plan(claim, why):
    honest = stats(tokens=48, unused=[(103, 1), (200, 2)])
    honest = dataclasses.replace(honest, loss_tokens=40, region=RegionFacts(replica_ids=(0, 1)))
    assert wire.refused_claim(honest, PLAN, seq_len=8) is None
    assert re.match(why, wire.refused_claim(dataclasses.replace(honest, **claim), PLAN, seq_len=8))


def test_a_reply_whose_summary_or_sizes_do_not_fit_is_refused_as_malformed():
    sent = dataclasses.replace(stats(), region=RegionFacts(replica_ids=(0, 2), reload=True))
    good = wire.reply_payload([np.zeros(4, dtype=np.uint8)], sent)
    assert wire.reply_of(good, max_bytes=1 << 20)[1] == sent
    head = frames.decode(good, 1 << 20).header
    bad = [{**head, "stats": {**head["stats"], "extra": 1}}, {**head, "sizes": [5]}, {"sizes": [4]}]
    # A region's facts are its claims only, each of its type: never its name, nor a refusal.
    for region in (None, {"replica_ids": [0], "name": "us"}, {"refused": "no"}, {"replica_ids": [True]}):
        bad.append({**head, "stats": {**head["stats"], "region": region}})
    for header in bad:
        with pytest.raises(frames.BadFrame, match="malformed"):
            wire.reply_of(frames.encode(header, b"\0" * 4), max_bytes=1 << 20)


def test_every_notice_from_the_home_crosses_as_its_type_and_an_unknown_one_is_refused():
    from diloco_ray.regions import notices
    from diloco_ray.regions.notices import Abort, SaveRequest, Stop

    job = wire.Notice(
        period=PeriodId(2, 1, 5),
        full=False,
        version=3,
        plan=((0, 4),),
        messages=("w/h/3/0",),
        reply="r",
        home="h",
    )
    for notice in (job, Abort(5), SaveRequest(3, ((4, True), (5, False)), "s/eu/x"), Stop()):
        payload = json.loads(json.dumps(notices.to_wire(notice)))  # as the channel carries it
        assert notices.from_wire(payload) == notice
    for bad in ({"resign": True}, {"abort": 1, "stop": True}, ["stop"]):
        with pytest.raises(ValueError, match="notice"):
            notices.from_wire(bad)
