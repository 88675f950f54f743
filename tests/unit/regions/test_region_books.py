"""A region's books follow the rank's rules (no Ray): what the home applied of the region's
messages plus what the region still holds is the sum of its merged pseudo-gradients, row by
row, through drops, a lost link, a re-run, a NaN replica, an agent restart and a restore.

A region here is its :class:`RegionBooks` over a :class:`RegionalMerge`, fed the notices the
home would send and its replicas' pseudo-gradients packed as one-rank replicas pack them;
the home is a counter of launches, a verdict per launch and the sum of the messages it
applied, decoded as its servers decode them."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo import compression, partition
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.regions import wire
from diloco_ray.regions.books import RegionBooks
from diloco_ray.regions.merge import RegionalMerge
from diloco_ray.runtime.messages import Contribution, PeriodId
from tests.unit.runtime.test_server_shards import make_config

SHAPES = {"embed": (40, 8), "norm": (8,), "up": (12, 8), "head": (36, 8)}  # fragments cut embed, up and head
WEIGHTS = {0: 10.0, 1: 30.0}  # each replica's tokens
FRESH = {"id": "home-1", "save": None}  # the home's restore directive: a new run


def config(codec="topk", servers=1, fragments=2, **fields):
    return make_config(
        pseudo_grad_compression=codec,
        error_feedback=True,
        error_feedback_decay=1.0,
        num_param_servers=servers,
        sync_fragments=fragments,
        **fields,
    )


def books_of(cfg, folder, shapes=SHAPES) -> RegionBooks:
    merge = RegionalMerge(shapes, cfg.sections().sync_codec, cfg.num_param_servers)
    return RegionBooks(merge, str(folder), "run", True, None)


def zeros(shapes=SHAPES) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}


def rows(t: torch.Tensor, iv: tuple[int, int]) -> torch.Tensor:
    return t[iv[0] : iv[1]]


def packed(grads: dict, fragment: int, cfg, shapes=SHAPES) -> list[list]:
    """Per server, every replica's contribution of ``fragment``'s rows (a one-rank replica's message)."""
    servers, out = cfg.num_param_servers, []
    for s in range(servers):
        target = SliceLayout(shapes, s, servers, cfg.sync_fragments).target(fragment)
        out.append([Contribution(rid, [_pack(g, target, list(shapes))], WEIGHTS[rid]) for rid, g in grads.items()])
    return out


def _pack(g: dict, target: dict, names: list):
    """The rows ``target`` of ``g``, fp32, as one uncompressed message of pieces."""
    pieces = {n: rows(g[n], iv).float() for n, iv in target.items()}
    return compression.pack_pieces(pieces, {n: iv[0] for n, iv in target.items()}, names, Codec("none"))[0]


def add_decoded(into: dict, buffers, names) -> None:
    """Add what ``buffers`` carry, read as the home's servers read them, into their rows."""
    for buf in buffers:
        for name, (start, values) in compression.unpack_pieces(buf, names)[0].items():
            target = rows(into[name], (start, start + partition.num_rows(values.shape)))
            target.add_(values.double().view(target.shape))


def add_mean(into: dict, grads: dict, accepted: list, fragment: int, fragments: int, shapes=SHAPES) -> None:
    total = sum(WEIGHTS[r] for r in accepted)
    for name, iv in partition.fragments(shapes, fragments)[fragment].items():
        rows(into[name], iv).add_(sum(WEIGHTS[r] * rows(grads[r][name], iv) for r in accepted) / total)


def notice(round_index, fragment, attempt, verdicts=(), restart=False, reset=False, reset_inner=False, restore=FRESH):
    return wire.Notice(
        period=PeriodId(round_index, fragment, attempt),
        full=False,
        version=attempt,
        plan=(),
        messages=(),
        reply="",
        home="h",
        reset=reset,
        restart=restart,
        reset_inner=reset_inner,
        sent_verdicts=tuple((a, ok) for a, ok in verdicts),
        restore=restore,
    )


def grads_for(step: int, nan: tuple = ()) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    out = {
        rid: {n: 0.1 * torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()} for rid in WEIGHTS
    }
    for rid in nan:  # NaN in every row: whichever fragment and server its period syncs
        out[rid] = {n: torch.full_like(t, float("nan")) for n, t in out[rid].items()}
    return out


def off_by(books: RegionBooks, applied: dict, merged: dict) -> float:
    """max |applied + residual - merged| over every row (the books' one rule)."""
    worst = 0.0
    for name, want in merged.items():
        held = books.ledger.residual.get(name, torch.zeros(want.shape)).double()
        worst = max(worst, float((applied[name] + held - want).abs().max()))
    return worst


class Region:
    """One region's side of a run, driven by the test as the home and its agent would."""

    def __init__(self, cfg, folder):
        self.cfg, self.folder, self.names = cfg, folder, list(SHAPES)
        self.books = books_of(cfg, folder)
        self.applied, self.merged = zeros(), zeros()
        self.sent: dict[int, list] = {}  # attempt -> buffers (what the home would apply)
        self.step = 0

    def begin(self, note: wire.Notice):
        return self.books.begin(note, list(WEIGHTS))

    def merge(self, note: wire.Notice, nan: tuple = ()):
        """The replicas' pseudo-gradients of the notice's period, merged into the region's message."""
        grads = grads_for(self.step, nan)
        self.step += 1
        fragment = note.period.fragment
        message = self.books.merge_period(fragment, packed(grads, fragment, self.cfg), note.period.attempt)
        if message.accepted:
            add_mean(self.merged, grads, message.accepted, fragment, self.cfg.sync_fragments)
            self.sent[note.period.attempt] = message.buffers
        return message

    def period(self, note: wire.Notice, nan: tuple = ()) -> tuple:
        """One period: the notice's rules, then the merge; (start, message)."""
        return self.begin(note), self.merge(note, nan)

    def home_applies(self, attempt: int) -> None:
        add_decoded(self.applied, self.sent[attempt], self.names)

    def check(self) -> float:
        assert not self.books.ledger.unsettled  # every verdict is in
        return off_by(self.books, self.applied, self.merged)


# ---- 1: a residual per row range, not per name ---------------------------------------------
def test_a_tensor_cut_by_fragments_keeps_each_pieces_residual_in_its_own_rows(tmp_path):
    """One 64x32 tensor over 2 fragments, topk, one replica: every message carries its own
    rows' values plus its own rows' residual, as a per-row reference computes it."""
    shapes = {"w": (64, 32)}
    cfg = make_config(pseudo_grad_compression="topk", error_feedback_decay=1.0, sync_fragments=2)
    merge = RegionalMerge(shapes, cfg.sections().sync_codec, 1)
    reference = torch.zeros(64, 32)  # the per-row residual a rank keeps
    g = torch.Generator().manual_seed(3)
    for attempt in range(6):
        fragment = attempt % 2
        iv = partition.fragments(shapes, 2)[fragment]["w"]
        piece = torch.randn(iv[1] - iv[0], 32, generator=g)
        buf = compression.pack_pieces({"w": piece}, {"w": iv[0]}, ["w"], Codec("none"))[0]
        message = merge.merge(fragment, [[Contribution(0, [buf], 1.0)]], attempt=attempt)
        sent = compression.unpack_pieces(message.buffers[0], ["w"])[0]["w"]
        assert sent[0] == iv[0]
        want = piece + reference[iv[0] : iv[1]]  # what the message stands for: its rows and their residual
        torch.testing.assert_close(sent[1] + merge.ledger.residual["w"][iv[0] : iv[1]], want, rtol=0, atol=1e-6)
        reference[iv[0] : iv[1]] = want - sent[1]
        merge.ledger.settle({attempt: True}, merge.read)
    torch.testing.assert_close(merge.ledger.residual["w"], reference, rtol=0, atol=1e-6)


def test_a_piece_not_applied_goes_back_into_its_own_rows_when_fragments_cut_a_tensor_unequally(tmp_path):
    """``b`` is rows (0, 2) in fragment 0 and (2, 14) in fragment 1: a "not applied" verdict
    puts each piece back where it came from (it used to raise in settle and end the agent)."""
    shapes = {"a.weight": (10, 8), "b.weight": (14, 8)}
    cfg = make_config(pseudo_grad_compression="topk", error_feedback_decay=1.0, sync_fragments=2)
    books = books_of(cfg, tmp_path, shapes)
    applied, merged = zeros(shapes), zeros(shapes)
    g = torch.Generator().manual_seed(5)
    sent = {}
    for attempt in range(4):
        fragment = attempt % 2
        grads = {0: {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}}
        target = partition.fragments(shapes, 2)[fragment]
        buf = _pack(grads[0], target, list(shapes))
        message = books.merge_period(fragment, [[Contribution(0, [buf], 1.0)]], attempt)
        for name, iv in target.items():
            rows(merged[name], iv).add_(rows(grads[0][name], iv))
        sent[attempt] = message.buffers
    books.settle({0: True, 1: False, 2: False, 3: True})
    for attempt in (0, 3):
        add_decoded(applied, sent[attempt], list(shapes))
    assert off_by(books, applied, merged) <= 1e-6


# ---- 2, 3, 4 and the suspected cases, each alone -------------------------------------------
def test_a_message_lost_with_its_link_is_put_back_when_the_region_hears_it_was_not_applied(tmp_path):
    region = Region(config(), tmp_path)
    region.period(notice(0, 0, 1))
    region.period(notice(0, 1, 2, verdicts=()))  # the link is cut: the home never gets this reply
    # Back two rounds later: the home tells it both launches' fate (the lost one: not applied).
    region.home_applies(1)
    region.books.begin(notice(2, 0, 7, verdicts=[(1, True), (2, False)]), list(WEIGHTS))
    assert region.check() <= 1e-6
    assert float(region.books.ledger.residual["head"].abs().max()) > 0  # the lost message's values are held


def test_a_replica_rejected_as_non_finite_inside_the_region_starts_its_next_round_fresh(tmp_path):
    region = Region(config(fragments=2), tmp_path)
    region.period(notice(0, 0, 1))
    _, message = region.period(notice(0, 1, 2, verdicts=()), nan=(1,))
    assert message.accepted == [0] and 1 in message.rejected
    assert region.books.resets_at_round_start  # its reply asks the home for the full weights then
    start = region.books.begin(notice(1, 0, 3, verdicts=[(1, True), (2, True)]), list(WEIGHTS))
    assert start.reset_inner == {1} and not start.reload  # that replica alone, at its next round
    again = region.books.begin(notice(1, 1, 4), list(WEIGHTS))
    assert again.reset_inner == set()  # once


def test_the_homes_verdict_that_the_regions_own_message_was_non_finite_resets_every_replica(tmp_path):
    region = Region(config(), tmp_path)
    region.period(notice(0, 0, 1))
    start = region.books.begin(notice(0, 1, 2, verdicts=[(1, False)], reset_inner=True), list(WEIGHTS))
    assert start.reset_inner == set(WEIGHTS) and region.books.ledger.residual == {}


def test_a_re_run_rewinds_the_residual_to_the_rounds_start_as_a_rank_does(tmp_path):
    region = Region(config(), tmp_path)
    region.period(notice(0, 0, 1))
    region.period(notice(0, 1, 2))
    region.begin(notice(1, 0, 3, verdicts=[(1, True), (2, True)]))
    at_start = {n: t.clone() for n, t in region.books.ledger.residual.items()}
    region.merge(notice(1, 0, 3))
    region.period(notice(1, 1, 4))
    # The servers died: restored from the checkpoint of round 1's start, the round runs again.
    region.books.begin(notice(1, 0, 5, restart=True, reset=True), list(WEIGHTS))
    assert region.books.ledger.unsettled == {}
    for name, t in at_start.items():
        torch.testing.assert_close(region.books.ledger.residual[name], t, rtol=0, atol=0)
    assert sum(float(t.abs().sum()) for t in at_start.values()) > 0  # (not wiped)


def test_an_agent_restarted_between_a_notice_and_its_next_save_loses_no_put_back(tmp_path):
    region = Region(config(), tmp_path)
    region.period(notice(0, 0, 1))
    region.books.save()  # before the upload of launch 1
    region.books.begin(notice(0, 1, 2, verdicts=[(1, False)]), list(WEIGHTS))  # put back, in memory
    # The agent dies here, before its next save; a new one takes up the books.
    region.books = books_of(region.cfg, tmp_path)
    assert region.books.load() is not None
    assert region.check() <= 1e-6  # (launch 1 not applied: all of it held again)
    assert float(region.books.ledger.residual["embed"].abs().max()) > 0


def test_a_restore_directive_takes_up_the_regions_part_of_the_checkpoint_once(tmp_path):
    region = Region(config(), tmp_path)
    region.period(notice(0, 0, 1))
    region.period(notice(0, 1, 2))
    region.books.settle({1: True, 2: False})
    tmp = region.books.begin_checkpoint(1)
    saved = region.books.commit_checkpoint(tmp, 1)
    kept = {n: t.clone() for n, t in region.books.ledger.residual.items()}
    region.period(notice(1, 0, 3))  # trained on past the checkpoint; then the home resumes from it
    resumed = {"id": "home-2", "save": saved}
    start = region.books.begin(notice(1, 0, 1, restore=resumed), list(WEIGHTS))
    assert start.reload and start.restore_from is not None and start.reset_inner == set()
    assert region.books.ledger.unsettled == {}  # the old home's launches are void
    for name, t in kept.items():
        torch.testing.assert_close(region.books.ledger.residual[name], t, rtol=0, atol=0)
    assert region.books.begin(notice(1, 1, 2, restore=resumed), list(WEIGHTS)).restore_from is None  # once
    # A home that starts over (or names a part this region does not hold) starts it fresh.
    fresh = region.books.begin(notice(0, 0, 1, restore={"id": "home-3", "save": {**saved, "digest": "0" * 64}}), [0, 1])
    assert fresh.reload and fresh.reset_inner == {0, 1} and region.books.ledger.residual == {}


# ---- the ledger over a whole run, in every combination that changes its path ----------------
@pytest.mark.parametrize("codec", ["topk", "int4"])
@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("fragments", [2, 3])
def test_applied_plus_held_is_every_merged_pseudo_gradient_through_every_fault(tmp_path, codec, servers, fragments):
    """Rounds of every sync applied, a late message, a replica poisoned, a link cut mid-round,
    an agent restarted as it takes a notice in, and a round run again after its servers were
    restored: at every round's start, and at the end, what the home applied plus what the
    region holds is the sum of the region's merged pseudo-gradients, to 1e-6 on every row."""
    region = Region(config(codec, servers, fragments), tmp_path)
    home = {"attempt": 0, "verdicts": {}}  # its launch counter; what it learnt since the region's last period

    def run(round_index, late=(), poisoned_at=None, lost_at=None, restart=False, agent_restarts=False):
        """One round's periods; what its first period started with."""
        starts = []
        for fragment in range(fragments):
            home["attempt"] += 1
            attempt, first = home["attempt"], fragment == 0
            verdicts, again = sorted(home["verdicts"].items()), restart and first
            note = notice(round_index, fragment, attempt, verdicts, restart=again, reset=again)
            home["verdicts"] = {}
            starts.append(region.begin(note))
            if first and agent_restarts:  # it dies having taken the notice in; a new one takes up the books
                region.books = books_of(region.cfg, tmp_path)
                assert region.books.load() is not None
            if first:
                assert region.check() <= 1e-6, round_index
            message = region.merge(note, nan=(1,) if poisoned_at == fragment else ())
            region.books.save()  # before the upload
            if poisoned_at == fragment:
                assert message.accepted == [0] and region.books.resets_at_round_start
            if lost_at == fragment:  # the link goes down before the reply crosses: the round goes on without it
                home["verdicts"][attempt] = False
                break
            home["verdicts"][attempt] = fragment not in late
            if fragment not in late:
                region.home_applies(attempt)
        return starts[0]

    run(0)
    run(1, late={0})
    run(2, poisoned_at=fragments - 1)
    assert run(3, lost_at=1).reset_inner == {1}  # the poisoned replica starts round 3 fresh
    run(4, agent_restarts=True)
    at_start = ({n: t.clone() for n, t in region.applied.items()}, {n: t.clone() for n, t in region.merged.items()})
    run(5)
    region.applied, region.merged = at_start  # the servers die and are restored at round 5's start
    home["verdicts"] = {}
    run(5, restart=True)
    region.books.settle(home["verdicts"])
    assert region.check() <= 1e-6
    assert sum(float(t.abs().sum()) for t in region.books.ledger.residual.values()) > 0


def test_the_books_load_without_running_code_and_are_written_through_no_link(tmp_path):
    import os
    import pickle

    class Planted:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    (tmp_path / "region_state.pt").write_bytes(pickle.dumps(Planted()))  # the old format's name
    outside = tmp_path / "outside.json"
    outside.write_text("untouched")
    os.symlink(outside, tmp_path / "region_state.json")
    region = Region(config(), tmp_path)
    region.period(notice(0, 0, 1))
    region.books.save()
    assert outside.read_text() == "untouched" and not os.path.islink(tmp_path / "region_state.json")
    assert books_of(region.cfg, tmp_path).load() is not None and not (tmp_path / "ran").exists()
    assert os.stat(tmp_path).st_mode & 0o077 == 0  # the region's folder is its own
