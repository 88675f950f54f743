"""The codecs where the values live, in ns per parameter: ``bench/run.py``'s GPU figure, and
``python bench/device_codec.py [--device cpu]`` for its parts (one code path on every device:
``--device cpu`` is the host's packing).

What a rank does with a pseudo-gradient and a weights message (``diloco_ray.algo.compression``
with a ``device``, ``diloco_ray.algo.device_copy``), on one flat fp32 tensor of ``numel``
values:

* encode: the message built on the device (header copied up, values encoded there);
* down: the message brought to the host through one pinned buffer (``to_host``; on the host
  nothing moves);
* up + decode: a host message staged into pinned memory, copied up and decoded there
  (``unpack_pieces``; on the host, decoded in place).

:func:`ns_per_param` is the round trip of all three, each step waited for as the rank waits
for it. :func:`check_against_pack` first holds the device's messages to the host's
``compression.pack`` / ``unpack``: the same values decoded (and, topk aside, the same bytes).
Without CUDA, a GPU run prints that it is skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diloco_ray.algo import codecs, compression, device_copy  # noqa: E402
from diloco_ray.algo.codecs import Codec  # noqa: E402


def encode(flat: torch.Tensor, codec: str, block: int = codecs.DEFAULT_BLOCK) -> torch.Tensor:
    """One tensor's message, built on ``flat``'s device (the rank's pack of a pseudo-gradient)."""
    shapes, fill = {"x": tuple(flat.shape)}, lambda _, out: out.copy_(flat)
    return compression.pack_pieces_filled(shapes, {"x": 0}, ["x"], fill, Codec(codec, block), {}, device=flat.device)


def decode(buf: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host message's tensor, decoded on ``device`` (the rank's apply of a weights message)."""
    pieces, _ = compression.unpack_pieces(buf, ["x"], device=device)
    return pieces["x"][1]


def check_against_pack(codec: str, block: int = codecs.DEFAULT_BLOCK, device: str = "cuda") -> None:
    """Raise if the device path decodes other values than ``compression.pack`` + ``unpack``
    on the host (a few blocks with a zero block and an odd length), or writes other bytes
    (topk's entries may stand in another order within a block: its values are compared)."""
    flat = torch.randn(3 * block + 1, generator=torch.Generator().manual_seed(0))
    flat[block : 2 * block] = 0
    host, _ = compression.pack_pieces({"x": flat}, {"x": 0}, ["x"], Codec(codec, block), {})
    (down,) = device_copy.to_host([encode(flat.to(device), codec, block)])
    if codec != "topk" and not np.array_equal(down, host):
        raise AssertionError(f"the device path's {codec} message differs from compression.pack_pieces'")
    expected = compression.unpack_pieces(host, ["x"])[0]["x"][1]
    if not torch.equal(decode(down, torch.device(device)).cpu(), expected):
        raise AssertionError(f"the device path's {codec} values differ from compression.unpack_pieces'")


def timings(codec: str, numel: int = 1 << 26, repeats: int = 10, device: str = "cuda") -> dict[str, float]:
    """Mean ns per value of each step over ``repeats`` round trips after two warm-up ones
    (which also fill the pinned-memory cache): ``encode``, ``down``, ``up_decode``."""
    check_against_pack(codec, device=device)
    flat = torch.randn(numel, device=device)
    where = torch.device(device)
    spent = {"encode": 0.0, "down": 0.0, "up_decode": 0.0}
    synchronize = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
    for trip in range(repeats + 2):
        synchronize()
        t0 = time.perf_counter()
        message = encode(flat, codec)
        synchronize()
        t1 = time.perf_counter()
        (down,) = device_copy.to_host([message])
        t2 = time.perf_counter()
        decode(down, where)
        synchronize()
        t3 = time.perf_counter()
        if trip >= 2:
            for key, seconds in zip(spent, (t1 - t0, t2 - t1, t3 - t2)):
                spent[key] += seconds
    return {key: seconds * 1e9 / (repeats * numel) for key, seconds in spent.items()}


def ns_per_param(codec: str, numel: int = 1 << 26, repeats: int = 10, device: str = "cuda") -> float:
    """Mean ns per value of the whole round trip: encode on the device, the message down,
    back up and decoded there (see :func:`timings`)."""
    return sum(timings(codec, numel, repeats, device).values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--codecs", default=",".join(codecs.CODECS))
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the host's packing")
    args = ap.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print("device_codec: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    name = torch.cuda.get_device_name() if args.device != "cpu" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}, {args.numel:,} fp32 values, ns per value")
    print(f"{'codec':6} {'encode':>8} {'down':>8} {'up+dec':>8} {'total':>8} {'B/value':>8}")
    for codec in args.codecs.split(","):
        t = timings(codec, args.numel, args.repeats, args.device)
        size = Codec(codec).nbytes(args.numel) / args.numel
        print(f"{codec:6} {t['encode']:8.4f} {t['down']:8.4f} {t['up_decode']:8.4f} {sum(t.values()):8.4f} {size:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
