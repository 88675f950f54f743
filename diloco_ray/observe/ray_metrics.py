"""The round figures as Ray metrics, so the Ray dashboard and Prometheus see a run live.

:class:`RoundMetrics` turns each round record (and the replicas' inner-step reports) into
``ray.util.metrics`` gauges and counters named ``diloco_<key>`` and tagged ``run``. Ray
exports them on every node's metrics agent (``ray start --metrics-export-port`` /
``ray.init(_metrics_export_port=...)``) with its ``ray_`` namespace in front, and counters
with Prometheus' ``_total`` suffix: ``diloco_eval_loss`` is scraped as
``ray_diloco_eval_loss``, ``diloco_tokens`` as ``ray_diloco_tokens_total``.

How Ray 2.60 exports them, found by reading ``ray/util/metrics.py`` and
``ray/_private/telemetry/open_telemetry_metric_recorder.py`` and by scraping a local
instance (``tests/integration/test_ray_metrics.py``):

* The driver exports its own metrics: its core worker sends them to the local metrics
  agent like any worker's, with ``include_dashboard=False`` too (the agent still runs
  when ``ray[default]`` is installed). So no helper actor is needed.
* A gauge is sent to the agent only in the report interval in which it was set (the
  emitter clears gauge observations after each export), and the agent drops a gauge
  series that has not been refreshed for two of its report intervals (20 s by default).
  A gauge set once per round would therefore vanish from ``/metrics`` between rounds
  that take longer than that. :class:`RoundMetrics` keeps the last value of each gauge
  series and sets it again from a daemon thread every half report interval.
* Counters are sent as deltas and accumulated by the agent, so they stay. A counter can
  only grow by a positive amount, so a counter series appears at its first increment
  (``ray_diloco_dropped_replicas_total`` only once a replica was dropped).
* Creating and setting metrics works with or without Ray initialised (values set without
  a running agent go nowhere); still, construction failures (a Ray build without the
  metrics backend) disable the exporter with a warning instead of failing training.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from typing import Optional

logger = logging.getLogger(__name__)

# Round-record keys exported as gauges: the latest round's figure.
GAUGE_KEYS = (
    "round",
    "replicas",
    "inner_steps",
    "train_loss",
    "eval_loss",
    "eval_ppl",
    "outer_lr",
    "pseudo_grad_norm",
    "peak_bytes_up",
    "peak_bytes_down",
    "round_seconds",
    "sync_seconds",
    "compute_seconds",
    "eval_seconds",
)

# Cumulative figures exported as counters, with how to get each round's increment
# (a round's own bytes or tokens are Prometheus' increase() over the round).
COUNTERS = {
    "tokens": ("tokens processed by the applied replicas", lambda r: r.get("tokens")),
    "bytes_up": ("bytes the replicas sent to the servers", lambda r: r.get("bytes_up")),
    "bytes_down": ("bytes the replicas read from the servers", lambda r: r.get("bytes_down")),
    "rounds": ("outer rounds completed", lambda r: 1),
    "dropped_replicas": (
        "replicas dropped from a round (late, failed, rejected)",
        lambda r: len(r.get("dropped") or ()),
    ),
}

# Seconds between refreshes of the gauges when Ray's report interval cannot be read.
_DEFAULT_REFRESH_S = 5.0


class RoundMetrics:
    """Exports round records and inner-step reports through ``ray.util.metrics``.

    Gauges ``diloco_<key>`` for the keys in :data:`GAUGE_KEYS` (the latest round's value),
    counters ``diloco_tokens``, ``diloco_bytes_up``, ``diloco_bytes_down``,
    ``diloco_rounds``, ``diloco_dropped_replicas``, all tagged ``run``; and gauges
    ``diloco_inner_loss`` / ``diloco_inner_lr`` tagged ``run`` and ``replica``. ``None``
    and non-finite values are skipped, so a gauge keeps its last finite value.

    Args:
        run_name: the ``run`` tag of every series (e.g. the basename of ``output_dir``),
            so several jobs on one cluster can be told apart.
        refresh_s: how often the last gauge values are set again (see the module
            docstring); default: half of Ray's ``metrics_report_interval_ms``.
    """

    def __init__(self, run_name: str, refresh_s: Optional[float] = None):
        self.run_name = str(run_name)
        self._tags = {"run": self.run_name}
        self._lock = threading.Lock()
        self._last: dict[tuple, tuple] = {}  # (name, replica) -> (gauge, tags, value)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._warned = False
        self.enabled = False
        try:
            from ray.util.metrics import Counter, Gauge

            self._gauges = {
                key: Gauge(f"diloco_{key}", f"DiLoCo round record: {key}", tag_keys=("run",)) for key in GAUGE_KEYS
            }
            self._counters = {
                key: Counter(f"diloco_{key}", f"DiLoCo: {desc}", tag_keys=("run",))
                for key, (desc, _) in COUNTERS.items()
            }
            self._inner = {
                key: Gauge(f"diloco_inner_{key}", f"DiLoCo inner {key}, per replica", tag_keys=("run", "replica"))
                for key in ("loss", "lr")
            }
        except Exception as e:  # metrics are a view on training, never a reason to stop it
            logger.warning("Ray metrics export disabled: %r", e)
            return
        self.enabled = True
        self.refresh_s = refresh_s if refresh_s is not None else _refresh_seconds()

    def record(self, record: dict) -> None:
        """Set the gauges and add to the counters from one round record."""
        if not self.enabled:
            return
        try:
            for key, gauge in self._gauges.items():
                value = _finite(record.get(key))
                if value is not None:
                    self._set(key, None, gauge, self._tags, value)
            for key, counter in self._counters.items():
                value = _finite(COUNTERS[key][1](record))
                if value is not None and value > 0:
                    counter.inc(value, tags=self._tags)
            # A replica left out of this round stops reporting inner figures; stop
            # refreshing its last ones so the dashboard does not show it as alive.
            ids = record.get("replica_ids")
            if ids is not None:
                keep = {str(i) for i in ids}
                with self._lock:
                    for k in [k for k in self._last if k[1] is not None and k[1] not in keep]:
                        del self._last[k]
        except Exception as e:
            self._warn(e)

    def step(self, replica_id: int, loss: float, lr: float) -> None:
        """Set ``diloco_inner_loss`` / ``diloco_inner_lr`` for one replica."""
        if not self.enabled:
            return
        tags = {**self._tags, "replica": str(replica_id)}
        try:
            for key, value in (("loss", loss), ("lr", lr)):
                value = _finite(value)
                if value is not None:
                    self._set(f"inner_{key}", tags["replica"], self._inner[key], tags, value)
        except Exception as e:
            self._warn(e)

    def close(self) -> None:
        """Stop refreshing the gauges (they age out of ``/metrics`` afterwards); safe to
        call twice. The refresh thread is a daemon, so a run that never calls this still
        exits."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> "RoundMetrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _set(self, name: str, replica: Optional[str], gauge, tags: dict, value: float) -> None:
        gauge.set(value, tags=tags)
        with self._lock:
            self._last[(name, replica)] = (gauge, tags, value)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._refresh_loop, name="diloco-ray-metrics", daemon=True)
                self._thread.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            with self._lock:
                series = list(self._last.values())
            try:
                for gauge, tags, value in series:
                    gauge.set(value, tags=tags)
            except Exception as e:
                self._warn(e)

    def _warn(self, error: Exception) -> None:
        if not self._warned:  # once: a broken exporter must not flood the driver's log
            self._warned = True
            logger.warning("Ray metrics export failed (further failures not logged): %r", error)


def _refresh_seconds() -> float:
    """Half of Ray's metrics report interval: a refreshed gauge is then in every export."""
    try:
        import ray

        return max(0.5, ray._config.metrics_report_interval_ms() / 2000.0)
    except Exception:
        return _DEFAULT_REFRESH_S


def _finite(value) -> Optional[float]:
    """``value`` as a float, or None for None, booleans, non-numbers and NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None
