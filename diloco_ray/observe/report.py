"""``diloco-ray report OUTPUT_DIR``: a picture and a summary table of a run.

Reads ``metrics.jsonl`` and writes ``report.png`` with four panels (train and eval loss,
replicas applied, bytes per round, sync vs compute time) and returns a plain-text table,
one row per round. It works on a run in progress (the file is appended line by line) and
on a resumed one (a round that was run again counts once, as its last record).
"""

from __future__ import annotations

import os

from diloco_ray import files
from diloco_ray.errors import DataError
from diloco_ray.observe.metrics import read_events


def load_rounds(output_dir: str) -> list[dict]:
    """The round records of a run; DataError if there are none to report."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise DataError(f"output_dir: '{output_dir}' has no metrics.jsonl (is it a diloco-ray run?)")
    latest: dict[int, dict] = {}
    for record in read_events(output_dir, "round"):
        latest[record["round"]] = record  # a round rerun after a crash: the last one stands
    if not latest:
        raise DataError(f"output_dir: '{path}' holds no round records yet")
    return [latest[r] for r in sorted(latest)]


def planned_rounds(output_dir: str) -> int | None:
    """``diloco_loops`` from the run's config.yaml (None if it cannot be read)."""
    import yaml

    try:
        with open(os.path.join(output_dir, "config.yaml")) as f:
            return int(yaml.safe_load(f)["diloco_loops"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def summary_table(rounds: list[dict], planned: int | None = None) -> str:
    """One row per round: loss, replicas, dropped, tokens, MB moved, seconds."""

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    header = (
        f"{'round':>5} {'train_loss':>10} {'eval_loss':>9} {'replicas':>8} {'dropped':>7} "
        f"{'tokens':>9} {'MB_up':>8} {'MB_down':>8} {'seconds':>7} {'sync_s':>6}"
    )
    rows = [header]
    for r in rounds:
        rows.append(
            f"{r['round']:>5} {fmt(r['train_loss'], '.4f'):>10} {fmt(r['eval_loss'], '.4f'):>9} "
            f"{r['replicas']:>8} {len(r['dropped']):>7} {r['tokens']:>9} "
            f"{r['bytes_up'] / 1e6:>8.2f} {r['bytes_down'] / 1e6:>8.2f} "
            f"{r['round_seconds']:>7.1f} {r['sync_seconds']:>6.2f}"
        )
    total_up = sum(r["bytes_up"] for r in rounds) / 1e6
    total_tokens = sum(r["tokens"] for r in rounds)
    total_down = sum(r["bytes_down"] for r in rounds) / 1e6
    sync = sum(r["sync_seconds"] for r in rounds)
    wall = sum(r["round_seconds"] for r in rounds)
    of = f" of {planned}" if planned else ""
    rows.append(
        f"{len(rounds)}{of} rounds, {total_tokens} tokens, {total_up:.2f} MB up / {total_down:.2f} MB down, "
        f"sync {sync:.1f}s of {wall:.1f}s ({100 * sync / wall if wall else 0:.0f}%)"
    )
    if planned and rounds[-1]["round"] + 1 < planned:
        rows.append(f"in progress (or stopped): last round {rounds[-1]['round']}, {planned} planned")
    return "\n".join(rows)


def plot(rounds: list[dict], path: str) -> None:
    """Write the four-panel figure to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [r["round"] for r in rounds]
    fig, grid = plt.subplots(2, 2, figsize=(13, 8))
    axes = grid.ravel()
    axes[0].plot(x, [r["train_loss"] for r in rounds], marker="o", label="train (inner mean)")
    evals = [(r["round"], r["eval_loss"]) for r in rounds if r["eval_loss"] is not None]
    if evals:
        axes[0].plot(*zip(*evals), marker="s", label="eval (after outer step)")
    axes[0].set(title="loss", xlabel="outer round", ylabel="loss")
    axes[0].legend()
    axes[1].step(x, [r["replicas"] for r in rounds], where="mid", label="applied")
    axes[1].bar(x, [len(r["dropped"]) for r in rounds], color="tab:red", alpha=0.5, label="dropped")
    axes[1].set(title="replicas per round", xlabel="outer round", ylim=(0, None))
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].legend()
    axes[2].bar([i - 0.2 for i in x], [r["bytes_up"] / 1e6 for r in rounds], width=0.4, label="up (to server)")
    axes[2].bar([i + 0.2 for i in x], [r["bytes_down"] / 1e6 for r in rounds], width=0.4, label="down")
    top = max(max(r["bytes_up"], r["bytes_down"]) for r in rounds) / 1e6
    axes[2].set(title="MB moved per round", xlabel="outer round", ylim=(0, 1.3 * top or 1.0))  # room for the legend
    axes[2].legend(loc="upper right")
    # Where a round's wall time went: inner steps, waiting on sync, eval.
    compute = [r.get("compute_seconds", r["round_seconds"] - r["sync_seconds"]) for r in rounds]
    sync = [r["sync_seconds"] for r in rounds]
    evals = [r.get("eval_seconds", 0.0) for r in rounds]
    axes[3].bar(x, compute, label="compute (inner steps)")
    axes[3].bar(x, sync, bottom=compute, label="sync", color="tab:orange")
    axes[3].bar(x, evals, bottom=[c + s for c, s in zip(compute, sync)], label="eval", color="tab:gray")
    axes[3].set(title="seconds per round", xlabel="outer round")
    axes[3].legend()
    fig.tight_layout()
    files.save_figure(fig, path, dpi=100)  # replaces a link at report.png, never writes through it
    plt.close(fig)


def write_report(output_dir: str) -> str:
    """Write ``output_dir/report.png``; return the summary table. A run in a bucket is
    read through its staging copy and gets its report.png uploaded beside it."""
    from diloco_ray.persist import storage

    mirror = storage.for_output_dir(output_dir)
    folder = mirror.local if mirror else output_dir
    if mirror:
        for name in ("metrics.jsonl", "config.yaml"):
            mirror.download(os.path.join(folder, name))
    rounds = load_rounds(folder)
    path = os.path.join(folder, "report.png")
    plot(rounds, path)
    if mirror:
        mirror.upload(path)
        path = mirror.remote(path)
    return summary_table(rounds, planned_rounds(folder)) + f"\nwrote {path}"
