"""``diloco-ray report OUTPUT_DIR/sweep``: every trial's eval-loss curve in one plot, and the
sweep's table.

Reads ``results.jsonl`` (written when the sweep ends) and writes ``report.png`` beside it:
one line a trial, eval loss against the outer round, a trial stopped early ending where it
stopped, a failed one dashed, the best drawn thickest.
"""

from __future__ import annotations

import os

from diloco_ray import files
from diloco_ray.errors import DataError
from diloco_ray.sweep.results import RESULTS_FILE, read_results, table


def is_sweep(folder: str) -> bool:
    """Whether ``folder`` holds a sweep's results."""
    return os.path.isfile(os.path.join(folder, RESULTS_FILE))


def write_sweep_report(folder: str) -> str:
    """Write ``folder/report.png``; return the sweep's table and where the plot went."""
    try:
        result = read_results(folder)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{os.path.join(folder, RESULTS_FILE)}: cannot be read as a sweep's results ({e})") from None
    if not result.trials:
        raise DataError(f"{os.path.join(folder, RESULTS_FILE)}: holds no trial")
    path = os.path.join(folder, "report.png")
    plot(result, path)
    return table(result) + f"\nwrote {path}"


def plot(result, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    best = result.best
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for t in result.trials:
        if not t.eval_curve:
            continue
        rounds, losses = zip(*t.eval_curve)
        label = " ".join(f"{k}={v}" for k, v in t.overrides.items())
        if t.status != "finished":
            label += f" ({t.status})"
        is_best = best is not None and t.trial == best.trial
        ax.plot(
            rounds,
            losses,
            marker="o",
            linestyle="--" if t.status == "failed" else "-",
            linewidth=3 if is_best else 1.5,
            label=label + (" - best" if is_best else ""),
        )
    ax.set(title=f"sweep: eval loss per trial ({len(result.trials)} trials)", xlabel="outer round", ylabel="eval loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    fig.tight_layout()
    files.save_figure(fig, path, dpi=100)  # replaces a link at the name, never writes through it
    plt.close(fig)
