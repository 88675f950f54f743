"""diloco-ray report on runs as they are found: in progress, resumed, with a torn line."""

import json

import pytest

from diloco_ray.errors import DataError
from diloco_ray.observe.report import load_rounds, summary_table, write_report


def record(r, **extra):
    return {
        "event": "round",
        "round": r,
        "train_loss": 2.0 - r / 10,
        "eval_loss": None if r == 1 else 1.5 - r / 10,
        "replicas": 2,
        "dropped": [],
        "tokens": 100,
        "bytes_up": 2_000_000,
        "bytes_down": 1_000_000,
        "round_seconds": 2.0,
        "sync_seconds": 0.5,
        "compute_seconds": 1.2,
        "eval_seconds": 0.3,
        **extra,
    }


def write_run(folder, lines, loops=5):
    (folder / "config.yaml").write_text(f"diloco_loops: {loops}\n")
    (folder / "metrics.jsonl").write_text(
        "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    )


def test_a_resumed_run_counts_a_rerun_round_once_and_an_unfinished_one_says_so(tmp_path):
    # Rounds 0-2, a crash, a resume from the checkpoint after round 1 reruns round 2.
    write_run(
        tmp_path,
        [
            record(0),
            record(1),
            record(2, train_loss=9.0),
            {"event": "checkpoint"},
            record(2),
            '{"event": "round", "rou',
        ],
    )
    rounds = load_rounds(str(tmp_path))
    assert [r["round"] for r in rounds] == [0, 1, 2] and rounds[2]["train_loss"] == pytest.approx(1.8)
    table = write_report(str(tmp_path))
    assert "3 of 5 rounds, 300 tokens, 6.00 MB up / 3.00 MB down, sync 1.5s of 6.0s (25%)" in table
    assert "in progress (or stopped): last round 2, 5 planned" in table
    assert (tmp_path / "report.png").stat().st_size > 10_000
    row = [line for line in table.splitlines() if line.split()[:1] == ["1"]][0]
    assert row.split()[2] == "-"  # no eval that round


def test_a_finished_run_is_not_called_in_progress(tmp_path):
    write_run(tmp_path, [record(r) for r in range(3)], loops=3)
    table = summary_table(load_rounds(str(tmp_path)), 3)
    assert "3 of 3 rounds" in table and "in progress" not in table


def test_no_rounds_yet_is_a_clear_error(tmp_path):
    write_run(tmp_path, [{"event": "membership"}])
    with pytest.raises(DataError, match="no round records yet"):
        write_report(str(tmp_path))


@pytest.mark.parametrize(
    "line,says",
    [
        ("[" * 100_000 + "]" * 100_000, "line 2 is nested too deeply"),
        ('{"event": "round", "pad": "' + "x" * (1 << 20) + '"}', "line 2 is over 1048576 bytes"),
        ("[1, 2, 3]", "line 2 is not a JSON object"),
    ],
    ids=["deeply-nested", "oversized", "not-an-object"],
)
def test_a_line_no_run_writes_is_one_line_and_exit_2(tmp_path, capsys, line, says):
    """A metrics.jsonl someone else wrote into: `diloco-ray report` says which file and line,
    exit 2, no traceback (a deeply nested line was a RecursionError)."""
    from diloco_ray import cli

    (tmp_path / "metrics.jsonl").write_text('{"event": "step", "round": 0}\n' + line + "\n")
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"diloco-ray: error: {tmp_path / 'metrics.jsonl'}: {says}; not a diloco-ray record\n"
