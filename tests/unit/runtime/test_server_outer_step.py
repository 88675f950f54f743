"""The public ``OuterOptimizer.step`` and the parameter servers' prepare -> reduce -> commit are
one outer step: on the same pseudo-gradients and weights they reject the same replicas for the
same reasons, clip by the same norm, use the same lr and round, and land on the same weights
(bit for bit on one server; to float64 rounding of the norm over several). No Ray.

Also: the round counter is the optimizer's own, moved only by its ``advance``."""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.outer import OuterOptimizer, Rejection
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import assemble_weights
from tests.unit.runtime.test_server_shards import make_config

SHAPES = {"embed": (7, 3), "w": (6, 4), "b": (5,)}
CLIP = 0.5
WEIGHTS = [1.0, 2.5, 4.0]


def start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def pseudo_grads(round_index: int) -> list[dict[str, torch.Tensor]]:
    """Three replicas' pseudo-gradients. Round 1: replica 1 holds a NaN (in the last rows of
    ``w``); round 3: every replica does, so nothing is applied."""
    g = torch.Generator().manual_seed(100 + round_index)
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in WEIGHTS]
    if round_index == 1:
        grads[1]["w"][5, 2] = math.nan
    if round_index == 3:
        for grad in grads:
            grad["b"][0] = math.inf
    return grads


def pack(tensors: dict[str, torch.Tensor], rows: dict[str, tuple[int, int]]) -> list:
    """The rows ``rows`` of full ``tensors``, packed fp32 as one rank sends them."""
    pieces = {n: tensors[n][a:b].clone() for n, (a, b) in rows.items()}
    buf, _ = compression.pack_pieces(pieces, {n: a for n, (a, _) in rows.items()}, list(SHAPES), Codec("none"))
    return [buf]


def make_servers(count: int, momentum_warmup: int = 0) -> list[ParameterServer]:
    cfg = make_config(
        outer_momentum_warmup_rounds=momentum_warmup,
        num_param_servers=count,
        outer_grad_clip=CLIP,
        outer_lr=0.7,
        outer_momentum=0.9,
        outer_lr_schedule="cosine",
        diloco_loops=5,
    )
    servers = []
    for s in range(count):
        server = ParameterServer(cfg.to_dict(), index=s)
        server.initialize(pack(start(), SliceLayout(SHAPES, s, count, 1).owned), SHAPES)
        servers.append(server)
    return servers


def public_optimizer(servers: list[ParameterServer]) -> OuterOptimizer:
    return OuterOptimizer(start(), servers[0].outer_optim)


def commit(servers: list[ParameterServer], grads: list[dict]) -> list:
    """One plain DiLoCo sync of ``grads`` on every server, as the driver chains it."""
    contributions = [
        [Contribution(rid, pack(g, server.layout.target(0)), WEIGHTS[rid]) for rid, g in enumerate(grads)]
        for server in servers
    ]
    plans = dict(zip(range(len(grads)), servers[0].data_plan(list(range(len(grads))))))
    prepared = [server.prepare(0, contributions[s]) for s, server in enumerate(servers)]
    reduced = [server.reduce(*prepared) for server in servers]
    return [server.commit(plans, *reduced) for server in servers]


@pytest.mark.parametrize("momentum_warmup", [0, 2])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_public_step_is_the_servers_step(count, momentum_warmup):
    servers = make_servers(count, momentum_warmup)
    public = public_optimizer(servers)
    for r in range(4):
        grads = pseudo_grads(r)
        applied = commit(servers, grads)[0]
        public.step(grads, WEIGHTS)
        info = public.last_step
        assert (applied.applied, applied.accepted, applied.round, applied.outer_lr) == (
            info.applied,
            info.accepted,
            info.round,
            info.lr,
        )
        assert {rid: (why.reason, str(why)) for rid, why in applied.rejected.items()} == {
            i: (why.reason, str(why)) for i, why in info.reasons.items()
        }
        assert servers[0].round_index() == public.round
        if r == 1:
            assert info.rejected == [1] and info.reasons[1].reason is Rejection.NON_FINITE
            assert str(info.reasons[1]) == "non-finite values in 'w'"
        if r == 3:
            assert not info.applied and info.rejected == [0, 1, 2] and public.round == 3
            continue
        assert info.grad_norm > CLIP  # the clip is active: the norm over every server matters
        got = assemble_weights([s.global_weights() for s in servers], SHAPES)
        if count == 1:  # the same calls on the same values: the same bits
            assert applied.pseudo_grad_norm == info.grad_norm
            for name, value in public.params.items():
                assert torch.equal(torch.from_numpy(got[name]), value), (r, name)
        else:  # the norm's float64 sum is split at other rows: its last bits may differ
            assert applied.pseudo_grad_norm == pytest.approx(info.grad_norm, rel=1e-12)
            for name, value in public.params.items():
                torch.testing.assert_close(torch.from_numpy(got[name]), value, rtol=1e-6, atol=1e-7)


def test_the_round_counter_moves_only_through_advance():
    opt = OuterOptimizer(start(), make_config().sections().outer_optim)
    with pytest.raises(AttributeError):
        opt.round = 5
    with pytest.raises(AttributeError):
        opt.round += 1
    opt.advance()
    assert opt.round == 1 and opt.state_dict()["round"] == 1
    restored = OuterOptimizer(start(), make_config().sections().outer_optim)
    restored.load_state_dict(opt.state_dict())
    assert restored.round == 1


def test_no_code_assigns_a_round_counter_from_outside():
    """Outside the class that owns it, nothing in the package stores to ``<x>.round``
    (an optimizer's round is read-only; a server's moves by ``advance``)."""
    package = pathlib.Path(__file__).resolve().parents[3] / "diloco_ray"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                is_store = isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                if is_store and isinstance(target, ast.Attribute) and target.attr == "round":
                    owner = ast.unparse(target.value)
                    if owner != "self":
                        found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
