"""A region's copy of the home's servers (regions.mirror), driven by each sync's record
(regions.records) through the frames that cross the channel: after every sync it holds the
home's servers' rows bit for bit (their digests agree) and hands its replicas the very
weights message the home's replicas apply; a copy a bit off is caught by the digest at the
next sync, one a version behind cannot take a sync, and one restored from the home's whole
state goes on from there. No Ray.

The home is tests/unit/runtime/test_server_shards.py's in-process servers and replicas:
topk pseudo-gradients with error feedback, int8 weights messages, two servers, replicas of
two ranks, two fragments, a replica poisoned with a NaN (rejected by every server) and one
that sits a period out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.channel import frames
from diloco_ray.regions import records
from diloco_ray.regions.mirror import Behind, Diverged, ServerMirror, local_call
from diloco_ray.runtime import transport
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server_group import assemble_weights, chain_sync
from tests.unit.runtime.test_server_decoupled import start_both
from tests.unit.runtime.test_server_shards import Sim

MAX = 1 << 30
CODECS = dict(pseudo_grad_compression="topk", topk_fraction=0.25, error_feedback=True, weights_compression="int8")


def home(fragments: int = 2) -> Sim:
    return Sim(num_servers=2, fragments=fragments, world_size=2, replicas=3, **CODECS)


def crossed_state(sim: Sim) -> list:
    """Every home server's whole state, as it comes through the channel."""
    return [records.state_from(records.state_payload(s.state()), MAX) for s in sim.servers]


def record_of_last_sync(sim: Sim, fragment: int) -> records.SyncRecord:
    """The last sync's record, through the frame that crosses the channel."""
    applied = sim.history[-1][0]
    record = records.record_of(
        fragment,
        sim.contributions,
        applied,
        [s.weights_digest() for s in sim.servers],
        transport.resolve,
    )
    return records.record_from(records.record_payload(record), MAX)


def same_message(a: np.ndarray, b: np.ndarray) -> bool:
    """The same weights message: the same values, bit for bit, and the same meta but the
    time it was sent."""
    (va, ma), (vb, mb) = compression.unpack(a), compression.unpack(b)
    ma, mb = ({k: v for k, v in m.items() if k != "sent_at"} for m in (ma, mb))
    same_values = va.keys() == vb.keys() and all(torch.equal(va[n], vb[n]) for n in va)
    return same_values and ma == mb


def run_and_mirror(sim: Sim, mirror: ServerMirror, rounds: range, faults: dict, from_fragment: int = 0) -> list:
    """Rounds of the home (the first from ``from_fragment`` on), each sync repeated by the
    mirror, which must hand out the home's messages and hold its digests; the records."""
    sent = []
    for r in rounds:
        ids = list(sim.replicas)
        plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
        for f in range(from_fragment if r == rounds[0] else 0, sim.cfg.sync_fragments):
            sim.sync(r, f, plans, **faults.get((r, f), {}))
            record = record_of_last_sync(sim, f)
            got = mirror.apply(record)
            assert [same_message(a, b) for a, b in zip(got, sim.messages)] == [True] * len(got), (r, f)
            assert mirror.digests() == [s.weights_digest() for s in sim.servers]
            sent.append(record)
    return sent


def test_a_copy_takes_every_sync_as_the_home_does_and_hands_out_the_same_messages():
    sim = home()
    mirror = ServerMirror(sim.cfg.to_dict())
    mirror.restore(crossed_state(sim))
    faults = {(1, 0): {"poison": (1, 0)}, (2, 1): {"absent": (2,)}}
    sent = run_and_mirror(sim, mirror, range(4), faults)
    poisoned = sent[2]
    assert 1 not in poisoned.accepted and (1, 2.0, 0) in poisoned.weights  # its weight still scales the sum
    assert all(len(server) == len(poisoned.accepted) for server in poisoned.pieces)
    held = assemble_weights([s.global_weights() for s in mirror.servers], sim.shapes)
    for name, value in sim.global_weights().items():
        assert np.array_equal(held[name].view(np.int32), value.view(np.int32)), name


def test_a_copy_a_bit_off_is_caught_at_the_next_sync_and_restored_from_the_whole_state():
    sim = home()
    mirror = ServerMirror(sim.cfg.to_dict())
    mirror.restore(crossed_state(sim))
    run_and_mirror(sim, mirror, range(1), {})
    rows = next(iter(mirror.servers[1].store.params.values()))
    flat = rows.view(-1)
    flat[0] = torch.from_numpy(np.frombuffer(np.float32(flat[0].item()).tobytes(), dtype=np.int32) ^ 1).view(
        torch.float32
    )[0]
    with pytest.raises(Diverged):
        run_and_mirror(sim, mirror, range(1, 2), {})
    assert mirror.version is None  # it holds nothing until the whole state comes again
    with pytest.raises(Behind):
        mirror.apply(record_of_last_sync(sim, 0))
    mirror.restore(crossed_state(sim))  # mid-round: its next sync is round 1's second fragment
    run_and_mirror(sim, mirror, range(1, 4), {}, from_fragment=1)


def test_a_copy_a_version_behind_cannot_take_a_sync():
    sim = home(fragments=1)
    mirror = ServerMirror(sim.cfg.to_dict())
    mirror.restore(crossed_state(sim))
    ids = list(sim.replicas)
    sim.sync(0, 0, dict(zip(ids, sim.servers[0].data_plan(ids))))  # the copy misses this one
    sim.sync(1, 0, dict(zip(ids, sim.servers[0].data_plan(ids))))
    with pytest.raises(Behind, match="holds version 0; the sync starts from 1"):
        mirror.apply(record_of_last_sync(sim, 0))


def test_a_record_whose_parts_do_not_match_is_refused():
    sim = home(fragments=1)
    ids = list(sim.replicas)
    sim.sync(0, 0, dict(zip(ids, sim.servers[0].data_plan(ids))))
    payload = records.record_payload(record_of_last_sync(sim, 0))
    frame = frames.decode(payload, MAX)
    header = {**frame.header, "accepted": frame.header["accepted"][:-1]}
    with pytest.raises(frames.BadFrame, match="do not match"):
        records.record_from(frames.encode(header, frame.payload), MAX)
    with pytest.raises(frames.BadFrame, match="run past"):
        records.record_from(frames.encode(frame.header, frame.payload[:-1]), MAX)


@pytest.mark.parametrize("momentum", ["delayed", "every_step"])
def test_a_copy_takes_decoupled_merges_stale_corrected_and_clipped_by_the_cycle(momentum):
    dec = Sim(2, 1, 1, 2, sync_mode="decoupled", decoupled_momentum=momentum, stale_correction="momentum",
              outer_grad_clip=0.01, **CODECS)  # fmt: skip
    mirror = ServerMirror(dec.cfg.to_dict())
    mirror.restore(crossed_state(dec))
    plans, bufs = start_both(dec)
    for rid, staleness in ((0, 0), (1, 1)):
        contributions = [[Contribution(rid, bufs[rid][s], 1.0 + rid, staleness)] for s in range(2)]
        merge = (3.0, {rid: (1.0 + rid) / 3.0})
        done = chain_sync(dec.servers, local_call, 0, contributions, {rid: plans[rid]}, {}, merge, digest=True)
        record = records.record_of(0, contributions, done.commits[0], done.digests, transport.resolve, merge)
        assert done.commits[0].pseudo_grad_norm > 0.01  # the clip binds
        got = mirror.apply(records.record_from(records.record_payload(record), MAX))
        assert [same_message(a, b) for a, b in zip(got, done.weights)] == [True, True], rid
    assert dec.servers[0].store.work == pytest.approx(1.0) and mirror.servers[0].store.work == dec.servers[0].store.work
