"""diloco_ray.observe.ray_metrics on a local Ray: round figures set in the driver reach the
Prometheus endpoint of the node's metrics agent, and gauges stay there between rounds."""

import math
import os
import re
import time
import urllib.request

import pytest
from conftest import free_port

from diloco_ray.observe.ray_metrics import RoundMetrics

pytestmark = pytest.mark.integration

# Ray's metrics report interval: how often workers (the driver too) send metrics to the
# agent; the agent also drops a gauge not refreshed for two intervals. 1 s (Ray's floor)
# keeps the test short and makes that drop visible within it.
REPORT_INTERVAL_MS = 1000
POLL_S = 30.0


@pytest.fixture(scope="module")
def metrics_port():
    """A local Ray with its Prometheus endpoint on a known port; yields the port."""
    import ray

    port = free_port()
    # The environment rather than _system_config: the agent reads this setting from its
    # own environment (inherited from here) to age out gauges, the driver reads it at init.
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = str(REPORT_INTERVAL_MS)
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=port)
        yield port
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old


def scrape(port, run):
    """``run``'s diloco series on the endpoint: {(name, replica or None): value}."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}  # the agent's endpoint not up yet
    out = {}
    for m in re.finditer(r"^(ray_diloco_\w+)\{(.*)\} (\S+)$", body, re.M):
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        if labels.get("run") == run:
            out[(m.group(1), labels.get("replica"))] = float(m.group(3))
    return out


def wait_for(port, run, check, timeout=POLL_S):
    """Scrape until ``check(series)`` holds; returns the series (or fails with the last)."""
    deadline = time.monotonic() + timeout
    while True:
        series = scrape(port, run)
        if check(series):
            return series
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout:.0f}s the endpoint shows {series}")
        time.sleep(0.25)


def round_record(index, **overrides):
    rec = {
        "event": "round",
        "round": index,
        "replicas": 2,
        "replica_ids": [0, 1],
        "dropped": [],
        "late": [],
        "inner_steps": 4,
        "tokens": 7680,
        "train_loss": 2.75,
        "eval_loss": 2.5,
        "eval_ppl": math.exp(2.5),
        "outer_lr": 0.7,
        "pseudo_grad_norm": 0.5,
        "bytes_up": 1000,
        "bytes_down": 4000,
        "peak_bytes_up": 1000,
        "peak_bytes_down": 4000,
        "round_seconds": 3.0,
        "sync_seconds": 0.25,
        "compute_seconds": 2.5,
        "eval_seconds": 0.2,
    }
    rec.update(overrides)
    return rec


def test_round_figures_reach_prometheus_from_the_driver(metrics_port):
    run = "test-round-figures"
    metrics = RoundMetrics(run)
    assert metrics.enabled and metrics.refresh_s == pytest.approx(0.5)
    try:
        metrics.step(0, 1.5, 1e-3)
        metrics.step(1, math.nan, 2e-3)  # NaN loss skipped, lr kept
        metrics.record(round_record(0))
        # Round 1: replica 1 dropped; no eval; a NaN train loss and no pseudo-gradient norm
        # leave those gauges at their last finite values.
        metrics.record(
            round_record(
                1,
                replicas=1,
                replica_ids=[0],
                dropped=[1],
                tokens=3840,
                train_loss=math.nan,
                eval_loss=None,
                eval_ppl=None,
                pseudo_grad_norm=None,
                round_seconds=4.0,
            )
        )
        want = {
            ("ray_diloco_round", None): 1.0,
            ("ray_diloco_replicas", None): 1.0,
            ("ray_diloco_eval_loss", None): 2.5,
            ("ray_diloco_train_loss", None): 2.75,
            ("ray_diloco_pseudo_grad_norm", None): 0.5,
            ("ray_diloco_outer_lr", None): 0.7,
            ("ray_diloco_round_seconds", None): 4.0,
            ("ray_diloco_tokens_total", None): 7680.0 + 3840.0,
            ("ray_diloco_bytes_up_total", None): 2000.0,
            ("ray_diloco_bytes_down_total", None): 8000.0,
            ("ray_diloco_rounds_total", None): 2.0,
            ("ray_diloco_dropped_replicas_total", None): 1.0,
            ("ray_diloco_inner_loss", "0"): 1.5,
            ("ray_diloco_inner_lr", "0"): 1e-3,
        }
        series = wait_for(metrics_port, run, lambda s: all(s.get(k) == pytest.approx(v) for k, v in want.items()))
        assert ("ray_diloco_inner_loss", "1") not in series

        # Two gauge lifetimes later the gauges are still there (refreshed), except the inner
        # figures of replica 1, which left the round.
        time.sleep(4 * REPORT_INTERVAL_MS / 1000)
        series = wait_for(metrics_port, run, lambda s: ("ray_diloco_inner_lr", "1") not in s, timeout=10)
        for key in [("ray_diloco_eval_loss", None), ("ray_diloco_round", None), ("ray_diloco_inner_loss", "0")]:
            assert series.get(key) == pytest.approx(want[key]), key
    finally:
        metrics.close()
    # Without the refresh a gauge ages out of the endpoint; counters stay.
    series = wait_for(metrics_port, run, lambda s: ("ray_diloco_eval_loss", None) not in s, timeout=15)
    assert series[("ray_diloco_tokens_total", None)] == 7680.0 + 3840.0
    metrics.close()


def test_nothing_exported_for_non_numbers_and_bad_values(metrics_port):
    run = "test-bad-values"
    with RoundMetrics(run) as metrics:
        metrics.record(
            {
                "round": 0,
                "replicas": 1,
                "eval_loss": "n/a",
                "train_loss": math.inf,
                "tokens": 0,
                "bytes_up": -5,
                "dropped": None,
                "round_seconds": True,
            }
        )
        metrics.step(3, None, 0.5)
        series = wait_for(
            metrics_port, run, lambda s: ("ray_diloco_inner_lr", "3") in s and ("ray_diloco_rounds_total", None) in s
        )
        assert series[("ray_diloco_round", None)] == 0.0 and series[("ray_diloco_inner_lr", "3")] == 0.5
        for name in (
            "eval_loss",
            "train_loss",
            "tokens_total",
            "bytes_up_total",
            "dropped_replicas_total",
            "round_seconds",
        ):
            assert (f"ray_diloco_{name}", None) not in series, name
        assert ("ray_diloco_inner_loss", "3") not in series
