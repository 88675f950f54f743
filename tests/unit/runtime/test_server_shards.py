"""ParameterServer driven in-process (no Ray cluster): sharded servers, streaming
fragments, rejection agreement, compressed weights, checkpoints.

Replicas are simulated with plain fp32 tensors: each rank of a replica holds its rows of
every parameter and a :class:`RankSync`; a "sync period" perturbs the local rows by a
deterministic amount that depends only on (round, fragment, replica) and the global row,
so every server count, fragment layout and world size trains on the same updates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import seal

from diloco_ray.algo import compression, partition
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.algo.sharding import shard_rows
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError
from diloco_ray.runtime import transport
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import assemble_weights


def fake_shapes(layers: int = 2) -> dict[str, tuple[int, ...]]:
    """A tiny Llama-like model, in model order."""
    shapes = {"model.embed_tokens.weight": (10, 4)}
    for i in range(layers):
        shapes[f"model.layers.{i}.mlp.up_proj.weight"] = (6, 4)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (4,)
    shapes["lm_head.weight"] = (10, 4)
    return shapes


SHAPES = fake_shapes()


def initial_weights(shapes=SHAPES, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def make_config(**overrides) -> TrainerConfig:
    fields = dict(max_steps=4, outer_lr=0.7, outer_momentum=0.9)
    fields.update(overrides)
    return TrainerConfig(
        model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", tokenizer_name="builtin:char", **fields
    )


def rows_of(shape, world_size: int, rank: int):
    """Index of a rank's rows in the full tensor (0-d: the whole tensor)."""
    return () if len(shape) == 0 else shard_rows(shape[0], world_size, rank)


def noise(shapes, round_index: int, fragment: int, replica: int) -> dict[str, torch.Tensor]:
    """Full-shape noise that depends only on (round, fragment, replica)."""
    g = torch.Generator().manual_seed(1_000_003 * round_index + 1009 * fragment + 17 * replica + 5)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


class Rank:
    def __init__(self, cfg: TrainerConfig, shapes, world_size: int, rank: int, full: dict[str, torch.Tensor]):
        self.sync = RankSync(
            shapes,
            world_size,
            rank,
            cfg.num_param_servers,
            cfg.sync_fragments,
            Codec(cfg.pseudo_grad_compression, cfg.compression_block),
            cfg.error_feedback,
            cfg.fragment_alpha,
        )
        self.local = {n: t[rows_of(t.shape, world_size, rank)].clone() for n, t in full.items()}
        self.rows = {n: rows_of(s, world_size, rank) for n, s in shapes.items()}


class ThroughRay:
    """A server called as through Ray: what a call returns is a copy (Ray copies a
    returned buffer into its object store), so a message stays valid after the server
    reuses the memory it was built in."""

    def __init__(self, server: ParameterServer):
        self.server = server

    def __getattr__(self, name):
        method = getattr(self.server, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            return out.copy() if isinstance(out, np.ndarray) else out

        return call


class Sim:
    """Servers and replicas, driven one sync at a time as the trainer chains them."""

    def __init__(
        self,
        num_servers: int = 1,
        fragments: int = 1,
        world_size: int = 1,
        replicas: int = 2,
        shapes=SHAPES,
        step: float = 0.01,
        **cfg,
    ):
        self.cfg = make_config(num_param_servers=num_servers, sync_fragments=fragments, **cfg)
        self.shapes, self.world_size, self.step = shapes, world_size, step
        init = initial_weights(shapes)
        self.replicas = {
            rid: [Rank(self.cfg, shapes, world_size, r, init) for r in range(world_size)] for rid in range(replicas)
        }
        seeds = [rank.sync.seed(rank.local) for rank in self.replicas[0]]  # [rank][server]
        self.servers = [ThroughRay(ParameterServer(self.cfg.to_dict(), index=s)) for s in range(num_servers)]
        for s, server in enumerate(self.servers):
            server.initialize([seeds[r][s] for r in range(world_size)], shapes)
        self.messages, self.full = [s.full_weights() for s in self.servers], True
        self.history: list[list] = []  # per sync: every server's AppliedRound

    # ---- replica side ---------------------------------------------------------------
    def receive(self, rid: int) -> None:
        version = self.servers[0].sync_version()
        for rank in self.replicas[rid]:
            decision = rank.sync.decide_load(version, fragment_message=not self.full)
            if decision == "full":
                rank.sync.apply([s.full_weights() for s in self.servers], rank.local)
                decision = rank.sync.decide_load(version, fragment_message=not self.full)
            if decision == "apply":
                rank.sync.apply(self.messages, rank.local)

    def train(self, rid: int, round_index: int, fragment: int) -> None:
        full = noise(self.shapes, round_index, fragment, rid)
        for rank in self.replicas[rid]:
            for n, t in rank.local.items():
                t.sub_(self.step * full[n][rank.rows[n]])

    def outgoing(self, rid: int, fragment: int) -> list[list[np.ndarray]]:
        """[server][rank] buffers."""
        per_rank = [rank.sync.outgoing(fragment, rank.local) for rank in self.replicas[rid]]
        return [[per_rank[r][s] for r in range(self.world_size)] for s in range(len(self.servers))]

    # ---- one sync ---------------------------------------------------------------------
    def sync(self, round_index: int, fragment: int, plans: dict, skip=(), poison=None, absent=(), lost=None):
        """One sync period: every replica takes in the latest message, trains, sends.

        Args:
            skip: replica ids that train and receive but do not contribute.
            poison: (replica id, server) whose pieces for that server get a NaN.
            absent: replica ids that sit the period out (receive nothing, send nothing).
            lost: (replica id, server) whose pieces for that server are lost in transit
                (:class:`LostInTransit`, with :func:`lossy_transport`).
        """
        contributions = [[] for _ in self.servers]
        for rid in self.replicas:
            if rid in absent:
                continue
            self.receive(rid)
            self.train(rid, round_index, fragment)
            bufs = self.outgoing(rid, fragment)
            if rid in skip:
                continue
            if poison is not None and poison[0] == rid:
                # The first rank that sends that server anything gets a NaN.
                r = next(r for r, b in enumerate(bufs[poison[1]]) if compression.unpack(b)[0])
                bufs[poison[1]][r] = with_value(bufs[poison[1]][r], *poison[2:])
            if lost is not None and lost[0] == rid:
                bufs[lost[1]] = [LostInTransit() for _ in bufs[lost[1]]]
            for s in range(len(self.servers)):
                contributions[s].append(Contribution(rid, bufs[s], 1.0 + rid))
        self.contributions = contributions  # what the servers were handed (a region's copy repeats it)
        prepared = [srv.prepare(fragment, contributions[s]) for s, srv in enumerate(self.servers)]
        reduced = [srv.reduce(*prepared) for srv in self.servers]
        applied = [srv.commit(plans, *reduced) for srv in self.servers]
        self.messages, self.full = [srv.new_weights_message(fragment) for srv in self.servers], False
        self.history.append(applied)
        return applied, reduced

    def round(self, round_index: int) -> list:
        ids = list(self.replicas)
        plans = dict(zip(ids, self.servers[0].data_plan(ids)))
        return [self.sync(round_index, f, plans) for f in range(self.cfg.sync_fragments)]

    def global_weights(self) -> dict[str, np.ndarray]:
        return assemble_weights([s.global_weights() for s in self.servers], self.shapes)

    def held(self) -> dict[str, np.ndarray]:
        return assemble_weights([s.full_weights() for s in self.servers], self.shapes)

    def anchors(self, rid: int) -> dict[str, torch.Tensor]:
        ranks = self.replicas[rid]
        return {
            n: torch.cat([r.sync.anchor[n] for r in ranks]) if len(s) else ranks[0].sync.anchor[n]
            for n, s in self.shapes.items()
        }


def with_value(buf: np.ndarray, value: float = float("nan"), count: int = 1) -> np.ndarray:
    """The same pieces, repacked with the first ``count`` values of the first set to ``value``."""
    tensors, meta = compression.unpack(buf)
    tensors = {n: t.clone() for n, t in tensors.items()}
    first = next(iter(tensors.values()))
    first.view(-1)[:count] = value
    return compression.pack(tensors, Codec("none"), meta)


def run(num_servers: int, fragments: int, world_size: int, replicas: int, rounds: int, **cfg) -> dict:
    """Final assembled global weights after ``rounds`` rounds."""
    sim = Sim(num_servers, fragments, world_size, replicas, **cfg)
    for r in range(rounds):
        sim.round(r)
    return sim.global_weights()


def max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(np.asarray(a[n]) - np.asarray(b[n])).max()) for n in a)


# ---------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("fragments", [1, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_server_count_does_not_change_the_weights(fragments, world_size):
    clip = 0.02
    ref_sim = Sim(1, fragments, world_size, 2, outer_grad_clip=clip)
    for r in range(3):
        ref_sim.round(r)
    # Clipping is active (so the cross-server norm matters) and the weights did move.
    norms = [h[0].pseudo_grad_norm for h in ref_sim.history]
    assert all(n is not None and n > 2 * clip for n in norms)
    reference = ref_sim.global_weights()
    assert max_diff(reference, {n: t.numpy() for n, t in initial_weights().items()}) > 1e-3
    for servers in (2, 3):
        got = run(servers, fragments, world_size, 2, 3, outer_grad_clip=clip)
        assert max_diff(got, reference) <= 1e-6, servers


def test_world_size_does_not_change_the_weights():
    a = run(2, 2, 1, 2, 2, outer_grad_clip=0.02)
    b = run(2, 2, 3, 2, 2, outer_grad_clip=0.02)
    assert max_diff(a, b) <= 1e-6


def test_every_server_reports_the_same_norm():
    sim = Sim(3, 2, 2, 2, outer_grad_clip=0.02)
    sim.round(0)
    for per_server in sim.history:
        norms = {a.pseudo_grad_norm for a in per_server}
        assert len(norms) == 1


# --------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("value,count,rejected", [(float("inf"), 1, True), (-float("inf"), 1, True), (3e38, 4, False)])
def test_finite_check_rejects_inf_but_not_finite_values_whose_sum_overflows(value, count, rejected):
    sim = Sim(1, 1, 1, 2)
    sim.round(0)
    plans = dict(zip(sim.replicas, sim.servers[0].data_plan(list(sim.replicas))))
    _, reduced = sim.sync(1, 0, plans, poison=(1, 0, value, count))
    assert (1 in reduced[0].reasons) == rejected
    if rejected:
        assert "non-finite" in str(reduced[0].reasons[1])


def test_sum_of_squares_in_chunks_matches_a_float64_copy():
    from diloco_ray.algo.aggregate import sum_of_squares as _sum_of_squares

    t = torch.randn(3, 1_000_003) * 1e3
    want = float(t.double().square().sum())
    assert _sum_of_squares(t, chunk=1 << 16) == pytest.approx(want, rel=1e-12)
    assert _sum_of_squares(torch.tensor(2.0)) == 4.0 and _sum_of_squares(torch.zeros(0)) == 0.0


class LostInTransit:
    """Stands for a ref whose object is gone: its node went down after the replica reported
    (with overlap, a rank lost between its stats and its messages)."""


@pytest.fixture
def lossy_transport(monkeypatch):
    """The servers' transport, raising Ray's error for a :class:`LostInTransit` piece."""
    import ray

    receive = transport.receive

    def lossy(items, link=None):
        if any(isinstance(i, LostInTransit) for i in items):
            raise ray.exceptions.RayError("its node went down")
        return receive(items, link)

    monkeypatch.setattr(transport, "receive", lossy)


@pytest.mark.parametrize("num_servers,fragments", [(1, 1), (2, 2)])
def test_a_message_lost_in_transit_is_rejected_by_every_server_as_if_never_sent(
    num_servers, fragments, lossy_transport
):
    lost, clean = Sim(num_servers, fragments, 2, 3), Sim(num_servers, fragments, 2, 3)
    for sim in (lost, clean):
        sim.round(0)
    ids = list(lost.replicas)
    plans = dict(zip(ids, lost.servers[0].data_plan(ids)))
    for f in range(fragments):
        applied, reduced = lost.sync(1, f, plans, lost=(1, num_servers - 1) if f == 0 else None)
        clean.sync(1, f, plans, skip={1} if f == 0 else ())
        if f == 0:  # lost on one server, rejected by all: the others' mean, as had it not sent
            for r in reduced:
                assert r.accepted == [0, 2] and "lost in transit" in str(r.reasons[1])
            for a in applied:
                assert a.applied and a.accepted == [0, 2] and set(a.rejected) == {1}
    assert max_diff(lost.global_weights(), clean.global_weights()) == 0.0


@pytest.mark.parametrize("num_servers,fragments", [(2, 1), (3, 2)])
@pytest.mark.parametrize("bad_server", [0, -1])
def test_nan_on_one_server_is_rejected_by_every_server(num_servers, fragments, bad_server):
    bad_server %= num_servers
    owned = partition.server_shards(SHAPES, num_servers)[bad_server]
    bad_fragment = next(
        f for f, rows in enumerate(partition.fragments(SHAPES, fragments)) if partition.intersect(owned, rows)
    )
    poisoned = Sim(num_servers, fragments, 2, 3)
    clean = Sim(num_servers, fragments, 2, 3)
    for sim in (poisoned, clean):
        sim.round(0)
    ids = list(poisoned.replicas)
    plans = dict(zip(ids, poisoned.servers[0].data_plan(ids)))
    for f in range(fragments):
        bad = f == bad_fragment
        applied, reduced = poisoned.sync(1, f, plans, poison=(1, bad_server) if bad else None)
        clean.sync(1, f, plans, skip={1} if bad else ())
        if bad:
            # Every server agrees: replica 1 is out, the others are in.
            for r in reduced:
                assert r.accepted == [0, 2]
                assert "non-finite" in str(r.reasons[1])
            for a in applied:
                assert a.applied and a.accepted == [0, 2]
                assert set(a.rejected) == {1}
            assert len({a.pseudo_grad_norm for a in applied}) == 1
    assert max_diff(poisoned.global_weights(), clean.global_weights()) == 0.0
    assert [s.plans.cursor for s in poisoned.servers] == [s.plans.cursor for s in clean.servers]
    if fragments == 1:
        # Replica 1's ranges go back to the cursor, to be handed out again.
        assert poisoned.servers[0].plans.cursor.returned == plans[1]
    else:
        # Streaming: its other fragment was applied, so its data counts as trained
        # (handing it out again would train it into that fragment twice).
        assert poisoned.servers[0].plans.cursor.returned == []


# ------------------------------------------------------------------ compressed weights


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_weights_compression_tracks_held(codec):
    sim = Sim(2, 2, 2, 2, weights_compression=codec, compression_block=16)
    fp32 = Sim(2, 2, 2, 2)
    qmax = {"int8": 127, "int4": 7}[codec]
    largest = 0.0  # the largest change any weights message carried
    for r in range(3):
        for f in range(2):
            plans = dict(zip(sim.replicas, sim.servers[0].data_plan([0, 1])))
            sim.sync(r, f, plans)
            fp32.sync(r, f, plans)
            for buf in sim.messages:
                tensors, meta = compression.unpack(buf)
                assert meta["delta"] is True and meta["fragment"] == f
                largest = max([largest] + [float(t.abs().max()) for t in tensors.values()])
        weights, held = sim.global_weights(), sim.held()
        # What the servers think replicas hold is what they hold, exactly.
        for rid in sim.replicas:
            sim.receive(rid)  # take in the last message, as the next period would
            anchors = sim.anchors(rid)
            for n in SHAPES:
                np.testing.assert_array_equal(anchors[n].numpy(), held[n])
        # It lags the exact weights by less than one quantisation step of a message, and
        # that error does not pile up from round to round.
        assert 0 < max_diff(held, weights) <= largest / qmax
    # The replicas' pseudo-gradients here do not depend on the weights they start from
    # (the simulated training adds fixed noise), so the server math is the fp32 run's.
    assert max_diff(sim.global_weights(), fp32.global_weights()) <= 1e-6


def test_topk_weights_track_what_replicas_hold():
    # A sparse delta leaves most of each change behind; the servers carry it (held lags
    # the weights) and replicas hold exactly what the servers think they hold.
    sim = Sim(2, 2, 2, 2, weights_compression="topk", compression_block=16, topk_fraction=0.25)
    for r in range(3):
        for f in range(2):
            sim.sync(r, f, dict(zip(sim.replicas, sim.servers[0].data_plan([0, 1]))))
    weights, held = sim.global_weights(), sim.held()
    for rid in sim.replicas:
        sim.receive(rid)
        anchors = sim.anchors(rid)
        for n in SHAPES:
            np.testing.assert_array_equal(anchors[n].numpy(), held[n])
    assert max_diff(held, weights) > 0


def test_weights_compression_messages_are_deltas():
    sim = Sim(1, 1, 1, 1, weights_compression="int8", compression_block=16)
    sim.round(0)
    _, meta = compression.unpack(sim.messages[0])
    assert meta["delta"] is True and meta["version"] == 1


# --------------------------------------------------------------------------- plain DiLoCo


@pytest.mark.parametrize("world_size,num_servers", [(1, 1), (2, 3)])
def test_plain_diloco_with_lr_one_lands_on_the_replica(world_size, num_servers):
    sim = Sim(num_servers, 1, world_size, 1, outer_lr=1.0, outer_momentum=0.0)
    for r in range(2):
        sim.round(r)
        weights = sim.global_weights()
        local = {n: torch.cat([rk.local[n] for rk in sim.replicas[0]]) for n in SHAPES}
        for n in SHAPES:
            np.testing.assert_allclose(weights[n], local[n].numpy(), rtol=0, atol=1e-6)
    assert sim.servers[0].round_index() == 2


def test_plain_diloco_applies_the_weighted_mean():
    sim = Sim(2, 1, 1, 2, outer_lr=1.0, outer_momentum=0.0)
    start = sim.global_weights()
    sim.round(0)
    expect = {}
    for n in SHAPES:
        mean = (1.0 * noise(SHAPES, 0, 0, 0)[n] + 2.0 * noise(SHAPES, 0, 0, 1)[n]) / 3.0
        expect[n] = start[n] - 0.01 * mean.numpy()
    assert max_diff(sim.global_weights(), expect) <= 1e-6


def test_plain_diloco_with_nothing_accepted_is_not_applied():
    sim = Sim(2, 1, 1, 1)
    ids = [0]
    plans = dict(zip(ids, sim.servers[0].data_plan([0])))
    before = sim.global_weights()
    applied, _ = sim.sync(0, 0, plans, poison=(0, 1))
    for a in applied:
        assert not a.applied and not a.round_done and a.pseudo_grad_norm is None
    assert all(s.sync_version() == 0 and s.round_index() == 0 for s in sim.servers)
    assert sim.servers[0].plans.cursor.frontier == 0
    assert max_diff(sim.global_weights(), before) == 0.0


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_replica_that_missed_a_sync_loads_everything(codec):
    sim = Sim(2, 2, 2, 2, weights_compression=codec, compression_block=16)
    sim.round(0)
    plans = dict(zip(sim.replicas, sim.servers[0].data_plan([0, 1])))
    sim.sync(1, 0, plans, absent={1})
    late = sim.replicas[1]
    assert [r.sync.versions for r in late] == [[1, 1]] * 2  # it missed version 2
    version = sim.servers[0].sync_version()
    assert late[0].sync.decide_load(version, fragment_message=True) == "full"
    sim.receive(1)
    assert [r.sync.versions for r in late] == [[version] * 2] * 2
    held, anchors = sim.held(), sim.anchors(1)
    for n in SHAPES:
        np.testing.assert_array_equal(anchors[n].numpy(), held[n])
        local = torch.cat([r.local[n] for r in late])
        np.testing.assert_array_equal(local.numpy(), held[n])
    sim.sync(1, 1, plans)  # and it takes part again
    assert [a.accepted for a in sim.history[-1]] == [[0, 1]] * 2


# ------------------------------------------------------------------------ AppliedRound


def test_applied_round_bookkeeping():
    sim = Sim(2, 2, 1, 3, max_steps=2, batch_size=1)
    per = sim.cfg.sequences_per_replica_round
    ids = list(sim.replicas)
    for r in range(2):
        plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
        # Round 0: replica 1 is rejected in fragment 0 only; replica 2 in fragment 1 only.
        first, _ = sim.sync(r, 0, plans, poison=(1, 0) if r == 0 else None)
        assert all(s.round_index() == r for s in sim.servers)
        second, _ = sim.sync(r, 1, plans, poison=(2, 1) if r == 0 else None)
        assert all(s.round_index() == r + 1 for s in sim.servers)
        for a in first:
            assert a.round == r and a.fragment == 0 and not a.round_done and a.data_ranges == {}
        for a in second:
            assert a.round == r and a.fragment == 1 and a.round_done
            # Each replica had a fragment applied, so each one's data counts as trained.
            assert a.data_ranges == plans
        if r == 0:
            assert [a.accepted for a in first] == [[0, 2]] * 2
            assert [a.accepted for a in second] == [[0, 1]] * 2
    assert all(s.sync_version() == 4 and s.store.fragment == 0 for s in sim.servers)
    # Nothing was handed out again: two rounds of three replicas, all fresh positions.
    assert sim.servers[0].plans.cursor.frontier == 6 * per
    assert sim.servers[0].plans.cursor.returned == []


def test_streaming_replica_missing_every_fragment_gets_its_data_handed_out_again():
    sim = Sim(1, 2, 1, 2, max_steps=2, batch_size=1)
    ids = list(sim.replicas)
    plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
    sim.sync(0, 0, plans, skip={1})
    second, _ = sim.sync(0, 1, plans, skip={1})
    assert second[0].data_ranges == {0: plans[0]}
    assert sim.servers[0].plans.cursor.returned == plans[1]


def test_sync_of_the_wrong_fragment_raises():
    sim = Sim(1, 2, 1, 1)
    with pytest.raises(RuntimeError, match="fragment 1"):
        sim.servers[0].prepare(1, [])


# ------------------------------------------------------------------------- checkpoints


def states(servers) -> list:
    return [(s.round_index(), s.store.fragment, s.sync_version(), s.plans.cursor.to_dict()) for s in servers]


@pytest.mark.parametrize("num_servers,fragments,codec", [(1, 1, "none"), (2, 2, "none"), (3, 2, "int8")])
def test_checkpoint_round_trip(tmp_path, num_servers, fragments, codec):
    sim = Sim(num_servers, fragments, 2, 2, weights_compression=codec, compression_block=16)
    sim.round(0)
    ids = list(sim.replicas)
    plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
    sim.sync(1, 0, plans)  # mid-round when streaming
    for s in sim.servers:
        s.save(str(tmp_path))
    seal(tmp_path)
    loaded = [ThroughRay(ParameterServer(sim.cfg.to_dict(), index=i)) for i in range(num_servers)]
    for s in loaded:
        s.load(str(tmp_path))
    assert states(loaded) == states(sim.servers)
    assert max_diff(assemble_weights([s.global_weights() for s in loaded], SHAPES), sim.global_weights()) == 0.0
    assert max_diff(assemble_weights([s.full_weights() for s in loaded], SHAPES), sim.held()) == 0.0
    for a, b in zip(loaded, sim.servers):  # the same message, sent anew (its send time is now)
        (ta, ma), (tb, mb) = compression.unpack(a.last_weights()), compression.unpack(b.last_weights())
        ma.pop("sent_at", None), mb.pop("sent_at", None)
        assert ma == mb and all(torch.equal(ta[n], tb[n]) for n in tb)

    # The next sync gives the same result on both (optimizer momentum included).
    fragment = sim.servers[0].store.fragment
    round_index = sim.servers[0].round_index()
    contributions = [[] for _ in sim.servers]
    for rid in sim.replicas:
        sim.receive(rid)
        sim.train(rid, round_index, fragment)
        for s, bufs in enumerate(sim.outgoing(rid, fragment)):
            contributions[s].append(Contribution(rid, bufs, 1.0 + rid))
    results = []
    for group in (sim.servers, loaded):
        prepared = [srv.prepare(fragment, contributions[s]) for s, srv in enumerate(group)]
        reduced = [srv.reduce(*prepared) for srv in group]
        applied = [srv.commit(plans, *reduced) for srv in group]
        messages = [srv.new_weights_message(fragment) for srv in group]
        results.append((applied, messages, assemble_weights([s.global_weights() for s in group], SHAPES)))
    (a0, m0, w0), (a1, m1, w1) = results
    assert max_diff(w0, w1) == 0.0
    assert max_diff(w0, assemble_weights([s.global_weights() for s in sim.servers], SHAPES)) == 0.0
    assert [(a.round, a.fragment, a.pseudo_grad_norm, a.round_done, a.data_ranges) for a in a0] == [
        (a.round, a.fragment, a.pseudo_grad_norm, a.round_done, a.data_ranges) for a in a1
    ]
    for x, y in zip(m0, m1):
        tx, mx = compression.unpack(x)
        ty, my = compression.unpack(y)
        mx.pop("sent_at"), my.pop("sent_at")
        assert mx == my
        for n in tx:
            assert torch.equal(tx[n], ty[n])
    assert states(loaded) == states(sim.servers)


def test_checkpoint_with_other_sync_fragments_is_refused(tmp_path):
    sim = Sim(1, 2, 1, 1)
    sim.servers[0].save(str(tmp_path))
    seal(tmp_path)
    other = ParameterServer(make_config(sync_fragments=1).to_dict(), index=0)
    with pytest.raises(ConfigError, match=r"^sync_fragments"):
        other.load(str(tmp_path))


@pytest.mark.parametrize("saved,loading", [(2, 1), (1, 2), (2, 3)])
def test_checkpoint_with_other_server_count_is_refused(tmp_path, saved, loading):
    sim = Sim(saved, 1, 1, 1)
    for s in sim.servers:
        s.save(str(tmp_path))
    seal(tmp_path)
    for i in range(loading):
        other = ParameterServer(make_config(num_param_servers=loading).to_dict(), index=i)
        with pytest.raises(ConfigError, match="num_param_servers"):
            other.load(str(tmp_path))


# ------------------------------------------------------------------- edge cases


def test_scalar_parameter_round_trips_through_the_server():
    shapes = {"scale": (), **SHAPES}
    sim = Sim(2, 1, 2, 1, shapes=shapes)
    sim.round(0)


def test_full_load_after_resuming_a_compressed_checkpoint_without_compression(tmp_path):
    sim = Sim(1, 1, 1, 1, weights_compression="int8", compression_block=16)
    sim.round(0)
    sim.servers[0].save(str(tmp_path))
    seal(tmp_path)
    server = ParameterServer(make_config(num_param_servers=1, sync_fragments=1).to_dict(), index=0)
    server.load(str(tmp_path))
    sim.servers, sim.messages, sim.full = [server], [server.full_weights()], True
    sim.round(1)
    assert max_diff(sim.held(), sim.global_weights()) == 0.0


def test_a_sync_that_commits_nothing_leaves_what_replicas_hold_unchanged():
    """weights_compression: a round that accepts nothing (to be run again) builds no new
    weights message, so the server's copy of what replicas hold stays with them."""
    sim = Sim(1, 1, 1, 2, weights_compression="int8", compression_block=16)
    sim.round(0)
    held_before, version = sim.held(), sim.servers[0].sync_version()
    message = sim.servers[0].last_weights()
    ids = list(sim.replicas)
    plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
    applied, _ = sim.sync(1, 0, plans, skip=set(ids))  # nothing arrives: not applied
    assert not applied[0].applied and sim.servers[0].sync_version() == version
    assert max_diff(sim.held(), held_before) == 0.0
    assert sim.messages[0] is message or np.array_equal(sim.messages[0], message)
    # The round run again is applied, and replicas then hold exactly what the server says.
    sim.round(1)
    for rid in ids:
        sim.receive(rid)
        assert max_diff({n: t.numpy() for n, t in sim.anchors(rid).items()}, sim.held()) == 0.0


@pytest.mark.parametrize("num_servers,world_size", [(1, 1), (2, 2), (3, 1)])
def test_sharded_servers_take_the_outer_step_of_outer_optimizer(num_servers, world_size):
    """One outer step: the servers' prepare/reduce/commit over slices and OuterOptimizer.step on
    whole tensors run the same aggregate functions, so with Nesterov momentum and an active
    global-norm clip they land on the same weights (to fp32 rounding of ``anchor - local``)."""
    from diloco_ray.algo.outer import OuterOptimizer

    clip = 0.05
    sim = Sim(num_servers, 1, world_size, 3, outer_grad_clip=clip, outer_lr=0.7, outer_momentum=0.9)
    reference = OuterOptimizer(initial_weights(), sim.cfg.sections().outer_optim)
    for r in range(3):
        ((applied, _),) = sim.round(r)
        # Every replica starts the round at the global weights and moves by step * noise.
        grads = [{n: sim.step * g for n, g in noise(SHAPES, r, 0, rid).items()} for rid in sim.replicas]
        reference.step(grads, [1.0 + rid for rid in sim.replicas])
        assert reference.last_step.grad_norm > clip  # the clip is active: the norm over slices matters
        assert applied[0].pseudo_grad_norm == pytest.approx(reference.last_step.grad_norm, rel=1e-6)
        want = {n: t.numpy() for n, t in reference.params.items()}
        assert max_diff(sim.global_weights(), want) <= 1e-6


def test_what_a_replica_had_no_time_for_goes_back_to_the_cursor():
    """inner_time_s: the commit takes each applied replica's unused ranges off its data_ranges
    and hands them out again first; on every server the same (only server 0 keeps the cursor)."""
    sim = Sim(2, 1, 1, 2)
    ids = list(sim.replicas)
    plans = dict(zip(ids, sim.servers[0].data_plan([0, 1])))
    per_replica = sim.cfg.sequences_per_replica_round
    assert plans == {0: [(0, per_replica)], 1: [(per_replica, per_replica)]}
    contributions = [[] for _ in sim.servers]
    for rid in ids:
        sim.receive(rid)
        sim.train(rid, 0, 0)
        for s, bufs in enumerate(sim.outgoing(rid, 0)):
            contributions[s].append(Contribution(rid, bufs, 1.0))
    prepared = [srv.prepare(0, contributions[s]) for s, srv in enumerate(sim.servers)]
    reduced = [srv.reduce(*prepared) for srv in sim.servers]
    tail = (per_replica - 3, 3)
    applied = [srv.commit(plans, *reduced, unused={0: [tail]}) for srv in sim.servers]
    assert applied[0].data_ranges == {0: [(0, per_replica - 3)], 1: plans[1]}
    assert sim.servers[0].plans.cursor.returned == [tail]
    assert sim.servers[0].data_plan([0]) == [[tail, (2 * per_replica, per_replica - 3)]]
