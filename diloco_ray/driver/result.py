"""What a run returns to the Python caller: :class:`TrainResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainResult:
    """What :meth:`DilocoFSDPTrainer.train` returns.

    Args:
        rounds: the round records of this run (as in metrics.jsonl), in order.
        output_dir: the run's folder.
        final_path: the Hugging Face model folder (``output_dir/final``).
    """

    rounds: list[dict] = field(default_factory=list)
    output_dir: str = ""
    final_path: str = ""

    @property
    def final_eval_loss(self) -> Optional[float]:
        return self.rounds[-1]["eval_loss"] if self.rounds else None
