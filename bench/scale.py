"""Memory and time per process at the sizes users train: ``python bench/scale.py [--quick]``.

Runs the default task (builtin arithmetic, character tokenizer) with Llama-style models of
~12M, ~41M and ~113M parameters (``--quick``; without it also ~350M) in three layouts --
2 replicas x 1 rank, 1 replica x 2 ranks (FSDP), and 2 replicas with 2 parameter servers
and int8 pseudo-gradients -- while a watcher samples every process's memory. Prints, per
process kind, bytes per parameter against the issue's goals, set-up, round, sync and save
time, and the extrapolation to 8B and 70B. Exits 1 when a figure misses its goal.

What is measured, and why:

* **Private resident memory** of each process: ``(resident - shared) pages`` from
  ``/proc/PID/statm``. Objects a process reads from Ray's object store are shared
  mappings, counted once under ``object store`` (``/dev/shm`` in use) instead of in every
  process that maps them.
* **Fixed overhead** per process kind (Python, torch, transformers, Ray, the data) is
  measured, not guessed: the same layout with the tiny model of ``configs/tiny.yaml``.
* **Gradient checkpointing on**, as at the sizes users train: the floors count state
  per parameter, and without it a step's activations (here about 8 B/param at 41M, more
  with longer sequences) would be measured as if they were per-parameter state.
* **Floors and goals** (the issue's): a rank's peak, at load and in training, within
  1.25 x (16 B/param for fp32 AdamW + 4 B/param anchor, over its replica's ranks, + its
  overhead); a server's peak within 12 B/param of its slice above its overhead; the
  driver never holds a full model (its growth under 4 B/param).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
import ray  # noqa: E402

from diloco_ray import DilocoFSDPTrainer, TrainerConfig  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
SIZES = {
    "12M": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 4},
    "41M": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 8},
    "113M": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 12},
    "350M": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16},
}
LAYOUTS = {
    "2x1": {"num_replicas": 2, "ranks_per_replica": 1},
    "1x2": {"num_replicas": 1, "ranks_per_replica": 2},
    "2x1,2srv,int8": {
        "num_replicas": 2,
        "ranks_per_replica": 1,
        "num_param_servers": 2,
        "pseudo_grad_compression": "int8",
    },
}
KINDS = {"RankWorker": "rank", "ParameterServer": "server"}


def private_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        _, resident, shared = (int(x) for x in f.read().split()[:3])
    return (resident - shared) * PAGE


class Watcher(threading.Thread):
    """Samples every rank, server and driver process's private memory, and the object
    store, every ``period`` seconds; keeps each kind's peak per phase."""

    def __init__(self, period: float = 0.1):
        super().__init__(daemon=True)
        self.period, self.phase, self.peaks = period, "load", {}
        self._done = threading.Event()
        self._kinds: dict[int, str] = {}

    def _kind(self, proc: psutil.Process) -> str | None:
        # Only a found kind is remembered: an idle Ray worker takes an actor's title later.
        if proc.pid not in self._kinds:
            try:
                title = " ".join(proc.cmdline()[:1])
            except psutil.Error:
                return None
            kind = next((k for c, k in KINDS.items() if title.startswith(f"ray::{c}")), None)
            if kind is None:
                return None
            self._kinds[proc.pid] = kind
        return self._kinds[proc.pid]

    def sample(self) -> None:
        seen = {"driver": private_bytes(os.getpid()), "object store": shutil.disk_usage("/dev/shm").used}
        for proc in psutil.process_iter():
            kind = self._kind(proc)
            if kind is not None:
                try:
                    seen[kind] = max(seen.get(kind, 0), private_bytes(proc.pid))
                except OSError:
                    pass
        for kind, value in seen.items():
            key = (self.phase, kind)
            self.peaks[key] = max(self.peaks.get(key, 0), value)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(self.period)

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_once(arch: dict, layout: dict, out: str) -> dict:
    """One training run under the watcher: peaks per (phase, kind) and the timings."""
    cfg = TrainerConfig(
        model_config={
            "model_type": "llama",
            "num_key_value_heads": arch["num_attention_heads"],
            "tie_word_embeddings": False,
            **arch,
        },
        dataset_name="builtin:arithmetic",
        seq_len=64,
        batch_size=4,
        max_steps=2,
        diloco_loops=2,
        warmup_steps=0,
        eval_batches=0,
        cpus_per_rank=1,
        server_cpus=1,
        output_dir=out,
        gradient_checkpointing=True,
        overwrite_output_dir=True,
        **layout,
    )
    _wait_for_exit()
    trainer = DilocoFSDPTrainer(cfg)
    watcher = Watcher()
    watcher.start()
    try:
        t0 = time.perf_counter()
        trainer.setup()
        setup_s = time.perf_counter() - t0
        watcher.sample()
        watcher.phase = "train"
        while trainer.round_index < cfg.diloco_loops:
            trainer.run_round()
        watcher.sample()
        watcher.phase = "save"
        t1 = time.perf_counter()
        trainer.save_final()
        save_s = time.perf_counter() - t1
        watcher.sample()
    finally:
        watcher.stop()
        trainer.shutdown()
    rounds = [r for r in trainer.records]
    params = sum(_numel(s) for s in trainer.shapes.values())
    return {
        "params": params,
        "peaks": {f"{p}/{k}": v for (p, k), v in watcher.peaks.items()},
        "setup_s": setup_s,
        "save_s": save_s,
        "round_s": sum(r["round_seconds"] for r in rounds) / len(rounds),
        "sync_s": sum(r["sync_seconds"] for r in rounds) / len(rounds),
    }


def _wait_for_exit(timeout: float = 60.0) -> None:
    """Wait until the last run's rank and server processes are gone: a killed actor's
    process takes a moment to exit, and counted in the next run it would pass for its
    own (a 2x1 rank's training peak read as a 1x2 rank's load peak)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [
            p
            for p in psutil.process_iter(["cmdline"])
            if any((p.info["cmdline"] or [""])[0].startswith(f"ray::{c}") for c in KINDS)
        ]
        if not alive:
            return
        time.sleep(0.2)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def figures(size: str, name: str, layout: dict, run: dict, base: dict) -> list[tuple]:
    """(label, value text, ok) for one run against its goals; ``base`` is the tiny run."""
    p, ranks = run["params"], layout["ranks_per_replica"]
    servers = layout.get("num_param_servers", 1)
    rows = []
    for phase in ("load", "train"):
        peak, over = run["peaks"][f"{phase}/rank"], base["peaks"][f"{phase}/rank"]
        floor = 20 * p / ranks + over
        rows.append(
            (
                f"rank_peak_{phase}[{size},{name}]",
                f"{peak / 1e9:.2f} GB = {(peak - over) / (p / ranks):.1f} B/param of its share above "
                f"{over / 1e9:.2f} GB overhead; floor {floor / 1e9:.2f} GB; ratio {peak / floor:.2f} goal <= 1.25",
                peak <= 1.25 * floor,
            )
        )
    peak = max(run["peaks"][f"{ph}/server"] for ph in ("train", "save"))
    over = max(base["peaks"][f"{ph}/server"] for ph in ("train", "save"))
    per = (peak - over) / (p / servers)
    rows.append(
        (
            f"server_peak[{size},{name}]",
            f"{peak / 1e9:.2f} GB = {per:.2f} B/param of its slice above {over / 1e9:.2f} GB overhead; goal <= 12",
            per <= 12,
        )
    )
    driver = max(v for k, v in run["peaks"].items() if k.endswith("/driver"))
    grew = driver - max(v for k, v in base["peaks"].items() if k.endswith("/driver"))
    rows.append(
        (
            f"driver_no_full_model[{size},{name}]",
            f"{grew / 1e9:.2f} GB above the tiny run = {grew / p:.1f} B/param; goal < 4 (a full fp32 model)",
            grew < 4 * p,
        )
    )
    store = max(v for k, v in run["peaks"].items() if k.endswith("/object store"))
    rows.append(
        (
            f"times[{size},{name}]",
            f"set-up {run['setup_s']:.1f} s, round {run['round_s']:.1f} s, "
            f"sync {run['sync_s']:.2f} s = {run['sync_s'] / p * 1e9:.1f} ns/param, save {run['save_s']:.1f} s; "
            f"object store peak {store / 1e9:.2f} GB",
            True,
        )
    )
    return rows


def extrapolate(results: dict) -> list[str]:
    """Per-process bytes at 8B and 70B from the largest size's bytes per parameter."""
    size = list(results)[-1]
    lines = []
    for name, (layout, run, base) in results[size].items():
        p = run["params"]
        rank = (run["peaks"]["train/rank"] - base["peaks"]["train/rank"]) / (p / layout["ranks_per_replica"])
        server_slice = p / layout.get("num_param_servers", 1)
        server = (run["peaks"]["train/server"] - base["peaks"]["train/server"]) / server_slice
        for total, ranks, servers in ((8e9, 8, 4), (70e9, 8, 8)):
            lines.append(
                f"extrapolated[{total / 1e9:.0f}B, {ranks} ranks/replica, {servers} servers, from {size} "
                f"{name}]: rank {rank * total / ranks / 1e9:.1f} GB ({rank:.1f} B/param of its share), "
                f"server {server * total / servers / 1e9:.1f} GB ({server:.1f} B/param of its slice)"
            )
    return lines


def write_markdown(rows: list[tuple], extrapolation: list[str], summary: str, path: str) -> None:
    """The figures as the markdown section BENCHMARKS.md includes (bench/run.py)."""
    lines = [
        f"`python bench/scale.py --quick` on {platform.machine()}, {os.cpu_count()} cores: {summary}.",
        "",
        "| figure | measured | within goal |",
        "|---|---|---|",
    ]
    lines += [f"| `{label}` | {text} | {'yes' if ok else 'NO'} |" for label, text, ok in rows]
    lines += [""] + [f"- {line}" for line in extrapolation]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12M, 41M and 113M only")
    ap.add_argument("--sizes", help="comma-separated subset of " + ",".join(SIZES))
    args = ap.parse_args()
    sizes = args.sizes.split(",") if args.sizes else list(SIZES)[:3] if args.quick else list(SIZES)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        base = {name: run_once(TINY, layout, os.path.join(tmp, "tiny")) for name, layout in LAYOUTS.items()}
        for size in sizes:
            results[size] = {}
            for name, layout in LAYOUTS.items():
                run = run_once(SIZES[size], layout, os.path.join(tmp, f"{size}-{name}"))
                results[size][name] = (layout, run, base[name])
                for row in figures(size, name, layout, run, base[name]):
                    rows.append(row)
                    print(f"{row[0]} {row[1]} {'OK' if row[2] else 'MISS'}", flush=True)
    extrapolation = extrapolate(results)
    for line in extrapolation:
        print(line)
    with open(os.path.join(HERE, "scale.json"), "w") as f:
        json.dump({s: {n: run for n, (_, run, _) in r.items()} for s, r in results.items()}, f, indent=1)
    missed = [r[0] for r in rows if not r[2]]
    summary = f"{len(rows) - len(missed)}/{len(rows)} figures within goal in {time.perf_counter() - started:.0f} s" + (
        f"; missed: {', '.join(missed)}" if missed else ""
    )
    write_markdown(rows, extrapolation, summary, os.path.join(HERE, "scale.md"))
    print(f"scale: {summary}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
