"""The embedded default's quality, guarded cheaply: a shorter ``configs/tiny.yaml`` (4 rounds
instead of 10, everything else as shipped) over seeds 1, 2 and 3 ends with a median final
eval loss under a bound (``bench/quality.py`` measures the full default over 5 seeds).

Only the median over the seeds is asserted, never one seed: on this task a seed's final
loss depends on its initial draw (some draws reach the floor later than others), so one
seed moves a lot with any change of order while the median moves little.

The bound was set from measurement on 2 CPU cores (2026-11-26, ``python bench/quality.py
--seeds 1,2,3 --modes sync --codecs none --set diloco_loops=4``) with the shipped lr 2e-3
and 30 warmup steps and the initial weights transformers itself gives for the seed
(``diloco_ray.model.hf_init``): 0.9984 / 0.9689 / 0.9552, median 0.9689. A synchronous run
is deterministic for its seed (the same losses to the last digit on every run). On main
1a6759f (lr 3e-3, 10 warmup steps, the per-module seeded draw of 0137b71, which made the
default end at median 0.827 over seeds 1-5) the same runs end at 1.0516 / 1.0625 / 1.1276,
median 1.0625. The bound, 1.01, sits between: 0.041 above today's median, 0.053 under the
regression's. (Over 3 rounds the two medians are 1.0486 and 1.0864, too close to tell
apart; over 5, 0.9208 and 1.0138, and a perturbed run, int8 pseudo-gradients with error
feedback or ``sync_mode: decoupled``, moved the median by at most 0.001. Over 20 seeds the
two draws share a median; what the test guards is the plateau some draws sat on at lr
3e-3, docs/results.md "Quality over seeds".)
About 30 s here (one Ray instance, three trainers of ~10 s each).
"""

from __future__ import annotations

import os
import statistics

import pytest

from diloco_ray import DilocoFSDPTrainer, TrainerConfig

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SEEDS = (1, 2, 3)
ROUNDS = 4
MEDIAN_BOUND = 1.01


def test_median_final_eval_loss_of_the_default_over_three_seeds(ray_local, tmp_path):
    losses = []
    for seed in SEEDS:
        overrides = {"output_dir": str(tmp_path / f"seed{seed}"), "seed": seed, "diloco_loops": ROUNDS}
        result = DilocoFSDPTrainer(TrainerConfig.from_yaml(TINY, overrides=overrides)).train()
        assert len(result.rounds) == ROUNDS
        losses.append(result.final_eval_loss)
    median = statistics.median(losses)
    each = " / ".join(f"{loss:.4f}" for loss in losses)
    assert median <= MEDIAN_BOUND, f"median final eval loss {median:.4f} over seeds {SEEDS} ({each}) > {MEDIAN_BOUND}"
