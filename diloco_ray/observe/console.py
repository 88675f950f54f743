"""What a training run shows on its console: a line saying what runs and where Ray's output
went, then the rounds as they go (bars on a terminal, plain lines in a log, as ``ray job
submit`` keeps), and a last line with the result. The ``diloco-ray train`` command hands it
to the trainer as a callback; the run's records are elsewhere (:mod:`~diloco_ray.observe.events`).
"""

from __future__ import annotations

import os
import sys
import time

from diloco_ray.config.sections import ChannelSection, MembershipSection, RunShapeSection
from diloco_ray.observe.progress import Progress


class ConsoleProgress:
    """Feeds the trainer's callbacks to a :class:`~diloco_ray.observe.progress.Progress` on
    stdout: bars on a terminal, plain lines otherwise (logs, ``ray job submit``); and says
    once what runs and where Ray's output went.

    Args:
        run: the run's section (its rounds, steps and mode).
        membership: the home's replica count.
        channel: the regions taking part, if any.
        verbose: Ray's output stays on the console (nothing to point at).
    """

    def __init__(
        self, run: RunShapeSection, membership: MembershipSection, channel: ChannelSection, verbose: bool = False
    ):
        self.run, self.replicas, self.regions = run, membership.num_replicas, list(channel.regions or ())
        self.verbose = verbose
        # stdout: bars on a terminal, and in a log the round lines users read as results.
        self.progress = Progress(run.diloco_loops, run.max_steps, stream=sys.stdout)
        self._started = time.monotonic()

    def on_train_begin(self, trainer) -> None:
        run = self.run
        resumed = f", resumed at round {trainer.round_index + 1}" if trainer.round_index else ""
        where = "" if self.verbose else f"; Ray's output: {os.path.join(trainer.run_dir.local, 'logs', 'ray.log')}"
        regions = "".join(
            f" + region {r['name']} ({r['replicas']} replica{'s' if r['replicas'] != 1 else ''}, one member)"
            for r in self.regions
        )
        print(
            f"diloco-ray: {self.replicas} replicas{regions}, {run.diloco_loops} rounds of {run.max_steps} inner steps, "
            f"{run.sync_mode} mode{resumed}{where}",
            flush=True,
        )
        self.progress.start(trainer.round_index)

    def on_round_begin(self, trainer, round_index: int, replicas: int) -> None:
        # A round's members: the home's replicas, and each region as one (its merged message).
        members = trainer.target_replicas + len(self.regions)
        self.progress.begin_round(round_index, replicas, target=members)

    def on_step(self, trainer, event: dict) -> None:
        self.progress.step(event["replica"], event["step"], event["loss"], event["lr"], event["tokens"])

    def on_round_end(self, trainer, record: dict) -> None:
        self.progress.end_round(record)

    def on_train_end(self, trainer) -> None:
        self.progress.close()

    def done_line(self, result) -> str:
        loss = result.final_eval_loss
        shown = "-" if loss is None else f"{loss:.4f}"
        return (
            f"done: {len(result.rounds)} rounds in {time.monotonic() - self._started:.0f}s, "
            f"eval_loss {shown}, model in {result.final_path}"
        )
