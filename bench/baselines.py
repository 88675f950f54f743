"""The baselines diloco-ray is measured against, each in this one process, no Ray.

* :func:`plain_loop` is the training loop a person would write for one replica: the same
  model, the same batches and the same inner optimizer (AdamW with the lr schedule and
  gradient clipping of the config), nothing else.
* :func:`hf_trainer` runs ``transformers.Trainer`` on the same model, batches, batch size
  and optimizer.

Model and batches come from an in-process :class:`~diloco_ray.runtime.rank.RankWorker` (built,
not run), so every figure compares the same tensors.
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch

from diloco_ray.algo.inner_schedule import inner_lr_at
from diloco_ray.algo.optimizers import build_inner_optimizer
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import plan as data
from diloco_ray.runtime.rank import RankWorker


def _worker(config: TrainerConfig) -> RankWorker:
    """A set-up rank of one replica with one rank: its model, data and optimizer."""
    worker = RankWorker(config.to_dict(), replica_id=0, rank=0, world_size=1)
    worker.setup()
    return worker


def _first_batches(worker: RankWorker, steps: int) -> list[list[np.ndarray]]:
    """``[step][micro] -> sample indices`` for the first ``steps`` steps of slot 0, the
    order DiLoCo's first replica reads them in (rounds of max_steps each)."""
    cfg = worker.config
    per_round = cfg.sequences_per_replica_round
    out: list[list[np.ndarray]] = []
    start = 0
    while len(out) < steps:
        out += data.rank_batches(
            [(start, per_round)], cfg.sections().data, 0, len(worker.tokens.train), worker.tokens.train.lengths
        )
        start += per_round
    return out[:steps]


def _median_rate(marks: list[tuple[float, int]]) -> float:
    """Median tokens/s over consecutive ``(time, tokens so far)`` marks."""
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
    return sorted(rates)[len(rates) // 2]


def plain_loop(config: TrainerConfig, steps: int, warmup: int = 3) -> dict:
    """Tokens/s of a plain PyTorch loop over the first ``steps`` steps (after ``warmup``
    untimed ones), with as many torch threads as a rank gets (``cpus_per_rank``): the
    median over chunks of ``max_steps`` steps, as DiLoCo's side is a median over rounds."""
    torch.set_num_threads(max(1, int(config.cpus_per_rank)))
    worker = _worker(config)
    model, train = worker.model, worker.tokens.train
    params = [p for _, p in worker.params]
    optimizer = build_inner_optimizer(params, config.sections().inner_optim)
    batches = _first_batches(worker, warmup + steps)
    model.train()
    tokens, t0, marks = 0, None, []
    for step, micro in enumerate(batches):
        if step == warmup:
            tokens, t0 = 0, time.perf_counter()
        if step >= warmup and (step - warmup) % config.max_steps == 0:
            marks.append((time.perf_counter(), tokens))
        for group in optimizer.param_groups:
            group["lr"] = inner_lr_at(step, config.sections().inner_optim)
        for idx in micro:
            batch = train.batch(idx, config.dynamic_batch)
            tokens += int(batch["attention_mask"].sum())
            (model(**batch).loss / config.grad_accum).backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    marks.append((time.perf_counter(), tokens))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": _median_rate(marks)}


class _Batches(torch.utils.data.Dataset):
    """Pre-cut batches as a data set of single rows, for Trainer's own collation."""

    def __init__(self, train, batches: list[list[np.ndarray]]):
        rows = [i for micro in batches for idx in micro for i in idx]
        self.train, self.rows = train, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        batch = self.train.batch(np.array([self.rows[i]]), False)
        return {k: v[0] for k, v in batch.items()}


def hf_trainer(config: TrainerConfig, steps: int, output_dir: str, warmup: int = 3) -> dict:
    """Tokens/s of ``transformers.Trainer`` on the same model, batches (in the same order),
    batch size, AdamW settings, lr schedule shape and gradient clipping; ``warmup`` steps
    are run first and not timed (a callback starts the clock)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(max(1, int(config.cpus_per_rank)))
    worker = _worker(config)
    batches = _first_batches(worker, warmup + steps)
    dataset = _Batches(worker.tokens.train, batches)
    clock: dict = {}

    counts = np.cumsum(
        [0]
        + [
            sum(int(worker.tokens.train.batch(idx, False)["attention_mask"].sum()) for idx in micro)
            for micro in batches
        ]
    )
    marks: list[tuple[float, int]] = []

    class StartClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            done = state.global_step - warmup
            if done == 0:
                clock["t0"] = time.perf_counter()
            if done >= 0 and done % config.max_steps == 0 or state.global_step == warmup + steps:
                marks.append((time.perf_counter(), int(counts[state.global_step] - counts[warmup])))

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=warmup + steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        lr_scheduler_type="cosine",
        warmup_steps=config.warmup_steps,
        max_grad_norm=config.max_grad_norm or 0.0,
        optim="adamw_torch",
        weight_decay=config.inner_opt_kwargs.get("weight_decay", 0.01),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=config.seed,
        dataloader_num_workers=config.num_workers,
        remove_unused_columns=False,
        data_seed=config.seed,
        dataloader_drop_last=True,
    )
    trainer = Trainer(model=worker.model, args=args, train_dataset=dataset, callbacks=[StartClock()])
    # Trainer would shuffle; the baseline reads the same batches in the same order.
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(dataset)
    with contextlib.redirect_stdout(sys.stderr):  # Trainer prints its summary: keep stdout to figures
        trainer.train()
    seconds = time.perf_counter() - clock["t0"]
    tokens = int(counts[warmup + steps] - counts[warmup])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": _median_rate(marks)}
