"""bench/wan.py --regions, short: two regions as separate Ray clusters in their own network
namespaces, joined only by the delaying relay on the channel's port, against the flat
layout (one Ray cluster over the same namespaces). The bytes on the regions' link agree
with what the home's records report, the fp32 regions run ends with the flat run's weights,
and nothing is left behind.

Needs root (network namespaces, veth pairs, tc); skipped with the reason otherwise.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import wan_links  # noqa: E402
import wan_regions  # noqa: E402

REASON = wan_links.why_not_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"bench/wan.py --regions {REASON}")
# The suite's size: the home and one region of two replicas each, fp32 only (its bytes
# dominate what crosses, and it is the run the flat one must match) over a 100 Mbit/s link
# (--quick's 20 would spend most of the time moving fp32 weights), 3 rounds of 5 steps
# (rounds 1-2 are the steady state the ratios read), no outage run.
SHORT = ["--regions", "2", "--quick", "--codec", "none", "--no-outage", "--no-equivalence-pair"]
SHORT += ["--quick-none-rate", "100"]
SHORT += ["--set", "diloco_loops=3", "--set", "max_steps=5", "--run-timeout", "300"]
ROW_KEYS = {
    "layout",
    "rate_mbit",
    "delay_ms",
    "codec",
    "overlap",
    "wan_wire_bytes_up",
    "wan_wire_bytes_down",
    "reported_bytes_up",
    "reported_bytes_down",
    "exposed_sync_fraction",
    "final_eval_loss",
    "round_seconds",
    "wall_seconds",
}


def env():
    venv_bin = os.path.dirname(sys.executable)  # `ray` and the interpreter of this suite
    return {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}


def test_regions_rehearsal_counts_the_bytes_and_matches_the_flat_run(tmp_path):
    out = tmp_path / "wan_regions.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "wan.py"), *SHORT, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"runs", "equivalence", "outage", "delay"}
    assert "relay" in result["delay"] and "not" in result["delay"]  # says what the delay does not model
    rows = {r["layout"]: r for r in result["runs"]}
    assert set(rows) == {"regions", "flat"}
    for row in rows.values():
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
    regions = rows["regions"]
    assert regions["delay_ms"] == 100 and regions["rate_mbit"] == 100
    # Only the channel crosses a region's link: what the home's records report for the
    # region is what its link carried, TLS, HTTP/2, TCP/IP headers and acknowledgements
    # included, both ways.
    for way in ("up", "down"):
        reported = regions[f"reported_bytes_{way}"]
        assert reported > 0, regions
        assert regions[f"wan_wire_bytes_{way}"] <= 1.10 * reported, (way, regions)
        assert regions[f"wan_wire_bytes_{way}"] >= reported, (way, regions)  # nothing crosses unseen
    # fp32, sync, no error feedback: the regions run is the flat run, to float round-off.
    assert result["equivalence"]["max_abs_diff"] <= 1e-5
    assert abs(regions["final_eval_loss"] - rows["flat"]["final_eval_loss"]) <= 1e-4
    assert result["outage"] is None
    assert wan_regions.leftovers() == [] and wan_links.leftovers() == []
