"""One rank on one GPU, without Ray: ``python bench/gpu_rank.py [--layers 16 --hidden 2048]``.

Builds a Llama-style model through the rank's own path (``modeling.build_model``: meta
device, then only the rank's rows allocated on the GPU and filled), runs AdamW inner steps
in bf16 autocast (with gradient checkpointing unless ``--no-gradient-checkpointing``), and
times one pseudo-gradient pack (``RankSync.start_outgoing``: ``anchor - local``, encoded,
as host bytes Ray can take) per codec, to the host and, on the GPU, on the stream the steps
run on (the copy down runs on its own, beside the next steps), three ways: on the GPU (the
rank's default: encoded there, one pinned copy down), the old host path with the anchor on
the GPU (each tensor copied down and encoded on the host), and ``anchor_on_host``. Each pack
is timed on its second call (the first allocates the pinned buffer and the residual).
Prints tokens/s, MFU (6 x parameters x tokens/s over the GPU's dense bf16 peak), peak GPU
memory in bytes per parameter, and ns per parameter of each pack.
For the device tool: Ray is not installed there, so the rank's parts are driven directly.
Without CUDA it prints that it is skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.rank_sync import RankSync  # noqa: E402
from diloco_ray.config.schema import TrainerConfig  # noqa: E402
from diloco_ray.data import tokenization
from diloco_ray.model import loading as modeling  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--no-gradient-checkpointing",
        dest="checkpointing",
        action="store_false",
        help="keep the activations (more memory) instead of recomputing them in the backward pass",
    )
    ap.add_argument("--codecs", default="none,int8,topk", help="codecs the GPU pack is timed with")
    ap.add_argument("--host-codecs", default="none", help="codecs the host paths are timed with (slow)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_rank: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return
    arch = {
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 128,
        "num_key_value_heads": args.hidden // 128,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    }
    cfg = TrainerConfig(
        model_config=arch,
        seq_len=args.seq,
        batch_size=args.batch,
        mixed_precision="bf16",
        gradient_checkpointing=args.checkpointing,
        output_dir="unused",
        attn_implementation="sdpa",
        dataset_name="builtin:arithmetic",
    )
    tok = tokenization.char_tokenizer()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = modeling.build_model(cfg.sections().model, cfg.sections().peft, tok, "cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = dict(modeling.trained_parameters(model))
    n = sum(p.numel() for p in params.values())
    load_peak = torch.cuda.max_memory_allocated()
    print(f"model {n / 1e9:.2f}B params, build {build_s:.1f} s, GPU peak at load {load_peak / n:.2f} B/param")
    step_fn = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(params.values(), lr=1e-4, fused=True)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda")
    timings = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        timings.append(time.perf_counter() - t)
    steady = sorted(timings[2:])[len(timings[2:]) // 2]
    tps = args.batch * args.seq / steady
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), 989e12)
    print(
        f"device {name}; step {steady * 1e3:.0f} ms, {tps:,.0f} tokens/s, MFU {6 * n * tps / peak:.1%} "
        f"(6 N T / {peak / 1e12:.0f} TFLOP/s), loss {float(loss):.3f}"
    )
    print(f"GPU peak in training {torch.cuda.max_memory_allocated() / n:.2f} B/param (AdamW fp32 floor 16 + anchor 4)")
    local = {k: p.data for k, p in params.items()}
    for codec in args.codecs.split(","):
        time_pack(local, n, codec, "on the GPU")
    for codec in args.host_codecs.split(","):
        time_pack(local, n, codec, "host path, anchor on the GPU")
        time_pack(local, n, codec, "anchor_on_host")


def time_pack(local: dict, n: int, codec: str, way: str) -> float:
    """Seconds of one ``RankSync.outgoing`` of ``local`` (against an anchor a little off,
    so there is a pseudo-gradient to encode) done ``way``, timed on its second call."""
    shapes = {k: tuple(p.shape) for k, p in local.items()}
    sync = RankSync(shapes, 1, 0, codec=Codec(codec), anchor_on_host=way == "anchor_on_host")
    sync.on_device = None if way != "host path, anchor on the GPU" else False
    sync.anchor = {k: sync._new_anchor(p) for k, p in local.items()}
    for anchor in sync.anchor.values():
        anchor.add_(1e-3)
    for _ in range(2):
        buf = copy = None  # the first call's pinned buffer goes back to torch's cache for the second
        torch.cuda.synchronize()
        began, queued = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        began.record()
        copy = sync.start_outgoing(0, local)
        queued.record()  # what the steps' stream spends; the copy down runs on its own stream
        (buf,) = copy.wait()
        s = time.perf_counter() - t
    busy = began.elapsed_time(queued) / 1e3
    print(
        f"sync pack {codec:5} {way:28}: {s:.3f} s = {s / n * 1e9:.3f} ns/param to the host, "
        f"{busy / n * 1e9:.3f} ns/param holding the steps' stream, message {buf.nbytes / n:.3f} B/param, "
        f"GPU now {torch.cuda.memory_allocated() / n:.2f} B/param"
    )
    del sync, buf
    return s


if __name__ == "__main__":
    main()
