"""Where a run's figures go: ``metrics.jsonl`` always, TensorBoard and W&B when asked.

:class:`MetricsLogger` takes one dict per event (``{"event": "round", ...}``) and fans it
out. ``metrics.jsonl`` is appended and flushed line by line, so a crash loses at most the
line being written and ``diloco-ray report`` can read a run while it goes on.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional


class MetricsLogger:
    """Writes events to ``output_dir/metrics.jsonl`` and the configured trackers.

    Args:
        output_dir: the run's folder (must exist).
        log_with: None, or a list of ``"tensorboard"`` / ``"wandb"``.
        log_dir: TensorBoard folder (default ``output_dir/logs``).
        run_config: the resolved config, recorded by W&B.
    """

    def __init__(self, output_dir: str, log_with: Optional[list] = None, log_dir: Optional[str] = None,
                 run_config: Optional[dict] = None):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        self._wandb = None
        log_with = log_with or []
        if "tensorboard" in log_with:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir or os.path.join(output_dir, "logs"))
        if "wandb" in log_with:
            import wandb

            self._wandb = wandb.init(project="diloco-ray", dir=output_dir, config=run_config or {},
                                     name=os.path.basename(os.path.abspath(output_dir)))

    def log(self, record: dict[str, Any]) -> None:
        """Append one event (stamped with ``time``); round events also go to the trackers,
        keyed by round."""
        record = {**record, "time": record.get("time", time.time())}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        if record.get("event") != "round":
            return
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) and k not in ("round", "time")}
        step = record["round"]
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"round/{k}", v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"round/{k}": v for k, v in scalars.items()}, step=step)

    def truncate_rounds(self, from_round: int) -> int:
        """Drop the round records from ``from_round`` on (they are about to be rerun),
        keeping this logger appending to the rewritten file."""
        self._file.close()
        try:
            return truncate_rounds(os.path.dirname(self.path), from_round)
        finally:
            self._file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_events(output_dir: str, event: Optional[str] = None) -> list[dict]:
    """The events of ``output_dir/metrics.jsonl`` (optionally one kind), skipping a torn
    last line."""
    out = []
    path = os.path.join(output_dir, "metrics.jsonl")
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if event is None or rec.get("event") == event:
                out.append(rec)
    return out


def truncate_rounds(output_dir: str, from_round: int) -> int:
    """Drop the round records with ``round >= from_round`` from metrics.jsonl (atomically),
    before those rounds are run again after a resume. Returns how many were dropped."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line torn by the crash being recovered from
                continue
            if rec.get("event") == "round" and rec.get("round", -1) >= from_round:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return dropped


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
