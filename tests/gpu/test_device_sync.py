"""The sync on a GPU against the host (the one codec path of tests/unit/algo/test_message_paths.py
on CUDA tensors): the same bytes for every codec (topk: the same
decoded values, its entries may stand in another order within a block), the same residuals,
the same weights after a message is applied, and the messages brought down through pinned
memory. Skipped without CUDA; no Ray.

Run on a GPU node with ``python -m pytest -q tests/gpu/test_device_sync.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression, device_copy, partition
from diloco_ray.algo.codecs import CODECS, Codec
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.algo.sharding import shard_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = torch.device("cuda", 0)
SHAPES = {"a": (2049,), "b": (33, 65), "c": (), "d": (0,), "e": (4097,), "f": (7,)}
BLOCK, FRACTION = 64, 0.1


def values(seed: int, bad: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    out["e"][BLOCK : 2 * BLOCK] = 0.0
    if bad is not None:
        out["e"][5] = float(bad)
    return out


def decoded(buf) -> dict[str, torch.Tensor]:
    return compression.unpack(buf)[0]


def assert_equal_values(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].cpu(), b[name].cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_a_message_built_on_the_gpu_is_the_hosts(codec, feedback, bad):
    host_values = values(1, bad)
    gpu_values = {n: t.to(GPU) for n, t in host_values.items()}
    g = torch.Generator().manual_seed(2)
    residual = {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()} if feedback else None
    res_host = {n: r.clone() for n, r in residual.items()} if feedback else None
    res_gpu = {n: r.to(GPU) for n, r in residual.items()} if feedback else None
    settings = Codec(codec, BLOCK, FRACTION)
    host = compression.pack_filled(SHAPES, lambda n, out: out.copy_(host_values[n]), settings, {"v": 1}, res_host)
    host = host.numpy()
    message = compression.pack_filled(
        SHAPES, lambda n, out: out.copy_(gpu_values[n]), settings, {"v": 1}, res_gpu, device=GPU
    )
    assert message.device.type == "cuda"
    (down,) = device_copy.to_host([message])
    assert torch.from_numpy(down).is_pinned()
    assert len(down) == len(host)
    if codec != "topk" and bad is None:  # NaN's bits and topk's entry order may differ (codecs)
        assert np.array_equal(down, host)
    assert_equal_values(decoded(down), decoded(host))
    if feedback:
        assert_equal_values(res_gpu, res_host)


@pytest.mark.parametrize("codec", CODECS)
def test_a_message_decoded_on_the_gpu_gives_the_hosts_values(codec):
    names = list(SHAPES)
    buf, _ = compression.pack_pieces(values(3, "nan"), dict.fromkeys(names, 0), names, Codec(codec, BLOCK), {})
    host, _ = compression.unpack_pieces(buf, names)
    gpu, _ = compression.unpack_pieces(buf, names, device=GPU)
    assert all(t.device.type == "cuda" for _, t in gpu.values())
    assert_equal_values({n: t for n, (_, t) in gpu.items()}, {n: t for n, (_, t) in host.items()})


def _mine(tensors: dict, device) -> dict[str, torch.Tensor]:
    return {n: (t[shard_rows(t.shape[0], 2, 1)] if t.dim() else t).clone().to(device) for n, t in tensors.items()}


def _message(tensors: dict, version: int, fragment=None, codec="none") -> np.ndarray:
    shapes = {n: t.shape for n, t in tensors.items()}
    target = partition.whole(shapes) if fragment is None else partition.fragments(shapes, 2)[fragment]
    meta = {"version": version, **({} if fragment is None else {"fragment": fragment, "delta": codec != "none"})}
    pieces = {n: partition.take(tensors[n], iv) for n, iv in target.items()}
    buf, _ = compression.pack_pieces(pieces, {n: iv[0] for n, iv in target.items()}, list(shapes), Codec(codec), meta)
    return buf


@pytest.mark.parametrize("codec", CODECS)
def test_a_gpu_ranks_sync_sends_and_holds_what_the_host_path_does(codec):
    """A rank on the GPU (the default: its sync works there) and the same rank's sync on the
    host, over syncs of two fragments with overlap's merge, compressed weights messages and a
    send the servers did not apply."""
    shapes = {"embed": (37, 64), "w": (19, 64), "norm": (64,), "scale": ()}
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    args = dict(servers=2, fragments=2, codec=Codec(codec, 16, 0.25), error_feedback=True, overlap=True)
    on_gpu, on_host = RankSync(shapes, 2, 1, **args), RankSync(shapes, 2, 1, **args)
    local = {"gpu": _mine(full, GPU), "host": _mine(full, "cpu")}
    on_gpu.apply([_message(full, 0)] * 2, local["gpu"])
    on_host.apply([_message(full, 0)] * 2, local["host"])
    assert all(a.device.type == "cuda" for a in on_gpu.anchor.values())
    for version in range(1, 5):
        step = _mine({n: torch.randn(s, generator=g) for n, s in shapes.items()}, "cpu")
        sent = {}
        for key, sync in (("gpu", on_gpu), ("host", on_host)):
            for n, rows in local[key].items():
                rows.sub_(0.05 * step[n].to(rows.device))
            sent[key] = sync.outgoing(version % 2, local[key], attempt=version)
        for a, b in zip(sent["gpu"], sent["host"]):
            assert_equal_values(decoded(a), decoded(b))
            if codec != "topk":
                assert np.array_equal(a, b)
        if version == 3:  # sync 2's messages were applied, sync 3's were not
            on_gpu.settle({2: True, 3: False})
            on_host.settle({2: True, 3: False})
        new = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        message = _message(new, version, version % 2, codec="int8")
        on_gpu.apply([message] * 2, local["gpu"], merge=True)
        on_host.apply([message] * 2, local["host"], merge=True)
        assert all(r.device.type == "cuda" for r in on_gpu.ledger.residual.values())
        assert_equal_values(on_gpu.ledger.residual, on_host.ledger.residual)
        assert_equal_values(on_gpu.anchor, on_host.anchor)
        assert_equal_values(local["gpu"], local["host"])


@pytest.mark.parametrize("codec,weights", [("int4", "int8"), ("none", "none")])
def test_a_server_on_the_gpu_steps_as_the_host_server_does(codec, weights, tmp_path):
    """``server_gpus``: a server in-process on the GPU against one on the host, over syncs
    of two fragments with clipping; then a checkpoint of the GPU server loads back onto the
    GPU and sends what it sent before."""
    from conftest import seal

    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.runtime.messages import Contribution
    from diloco_ray.runtime.server import ParameterServer

    shapes = {"embed": (40, 64), "w": (24, 64), "norm": (64,)}
    names = list(shapes)

    def server(gpus: float) -> ParameterServer:
        cfg = TrainerConfig(
            model_config={"model_type": "llama"},
            dataset_name="builtin:arithmetic",
            **dict(max_steps=4, outer_lr=0.7, outer_momentum=0.9, compression_block=16, sync_fragments=2),
            **dict(pseudo_grad_compression=codec, weights_compression=weights, outer_grad_clip=0.5, server_gpus=gpus),
        )
        g = torch.Generator().manual_seed(0)
        seed = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        buf, _ = compression.pack_pieces(seed, dict.fromkeys(names, 0), names, Codec("none"), {"version": 0})
        out = ParameterServer(cfg.to_dict())
        out.initialize([buf], shapes)
        return out

    on_gpu, on_host = server(1.0), server(0.0)
    assert all(t.device.type == "cuda" for t in on_gpu.store.params.values())
    for r in range(3):
        plans = dict(zip([0, 1], on_host.data_plan([0, 1])))
        for fragment in range(2):
            target = partition.fragments(shapes, 2)[fragment]
            g = torch.Generator().manual_seed(10 * r + fragment)
            contributions = []
            for rid in (0, 1):
                pieces = {n: 0.05 * torch.randn(iv[1] - iv[0], *shapes[n][1:], generator=g) for n, iv in target.items()}
                buf, _ = compression.pack_pieces(
                    pieces, {n: iv[0] for n, iv in target.items()}, names, Codec(codec), {}
                )
                contributions.append(Contribution(rid, [buf], 1.0 + rid))
            messages = []
            for srv in (on_gpu, on_host):
                applied = srv.commit(plans, srv.reduce(srv.prepare(fragment, contributions)))
                messages.append(srv.new_weights_message(fragment).copy())
                assert applied.applied
            got = [compression.unpack_pieces(m, names)[0] for m in messages]
            for n in got[1]:
                torch.testing.assert_close(got[0][n][1], got[1][n][1], rtol=1e-5, atol=1e-6)
    sent = on_gpu.full_weights().copy()
    on_gpu.save(str(tmp_path))
    seal(tmp_path)
    again = server(1.0)
    again.load(str(tmp_path))
    assert all(t.device.type == "cuda" for t in again.store.params.values())
    assert np.array_equal(
        compression.unpack(again.full_weights())[0]["0"].numpy(), compression.unpack(sent)[0]["0"].numpy()
    )


def test_a_message_comes_down_while_the_next_kernels_run():
    """The copy down runs on a stream of its own: kernels queued after it (the next
    period's steps) do not wait for it, and it does not wait for them."""
    sent = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    message = sent.to(GPU)
    torch.cuda.synchronize()
    copy = device_copy.DownCopy([message])
    del message  # held by the copy until it ends (its memory is not handed out before)
    torch.cuda._sleep(2_000_000_000)  # about a second of the steps' stream, queued after the copy
    (down,) = copy.wait()
    assert not torch.cuda.current_stream().query()  # the copy ended while the steps still ran
    torch.cuda.synchronize()
    assert np.array_equal(down, sent.numpy()) and torch.from_numpy(down).is_pinned()
