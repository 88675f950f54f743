"""The fault plan: parsing, matching by place and time, firing once (no Ray)."""

import pytest

from diloco_ray.config import fault_plan as faults
from diloco_ray.errors import ConfigError

PLAN = [
    {"kind": "slow", "replica": 1, "round": 2, "step": 1, "seconds": 0.01},
    {"kind": "nan", "replica": 1, "rank": 1, "round": 2, "step": 3},
    {"kind": "drop_link", "replica": 0, "round": 1},
    {"kind": "kill", "target": "server", "round": 4, "index": 1},
    {"kind": "term", "target": "driver", "round": 5},
]


def test_parse_keeps_every_field_and_defaults_the_rest():
    parsed = faults.parse(PLAN)
    assert parsed[0] == faults.Fault(kind="slow", round=2, replica=1, step=1, seconds=0.01)
    assert parsed[2] == faults.Fault(kind="drop_link", round=1)  # replica 0, rank 0, step 0
    assert parsed[3].target == "server" and parsed[3].index == 1
    assert faults.parse(None) == []


@pytest.mark.parametrize(
    "entry, field",
    [
        ({"kind": "freeze", "target": "server", "round": 1}, "fault_plan[0].kind"),
        ({"kind": "kill", "target": "moon", "round": 1}, "fault_plan[0].target"),
        ({"kind": "kill", "round": 1, "step": 1.5}, "fault_plan[0].step"),
        ({"kind": "kill", "round": True}, "fault_plan[0].round"),
        ({"kind": "slow", "round": 1, "seconds": -1}, "fault_plan[0].seconds"),
        ({"kind": "slowdown", "round": 0}, "fault_plan[0].factor"),
        ({"kind": "slowdown", "round": 0, "factor": 1.0}, "fault_plan[0].factor"),
    ],
)
def test_bad_entries_name_the_field(entry, field):
    with pytest.raises(ConfigError, match=rf"^{__import__('re').escape(field)}:"):
        faults.parse([entry])


def test_for_rank_and_due_select_by_place_and_time():
    plan = faults.parse(PLAN)
    mine = faults.for_rank(plan, replica_id=1, rank=0)
    assert [f.kind for f in mine] == ["slow"]
    assert faults.due(mine, 2, step=1) == mine and faults.due(mine, 2, step=2) == []
    assert faults.due(mine, 2, step=1, fired=frozenset({mine[0].key})) == []
    assert [f.index for f in faults.due(plan, 4, target="server")] == [1]
    assert [f.kind for f in faults.due(plan, 5, target="driver")] == ["term"]


def test_rank_faults_fire_once_and_last_one_period():
    rank1 = faults.RankFaults(faults.for_rank(faults.parse(PLAN), 1, 1))
    assert rank1.at_step(2, 2) is False
    assert rank1.at_step(2, 3) is True  # the poisoned step
    rank1.start_period()
    assert rank1.at_step(2, 3) is False  # a re-run of the round does not fire it again
    slow = faults.RankFaults(faults.for_rank(faults.parse(PLAN), 1, 0))
    slow.at_step(2, 1)
    assert slow.extra_seconds == 0.01
    slow.at_step(2, 2)
    assert slow.extra_seconds == 0.01  # each remaining step of the period is slower
    slow.start_period()
    assert slow.extra_seconds == 0.0
    link = faults.RankFaults(faults.for_rank(faults.parse(PLAN), 0, 0))
    link.at_step(1, 0)
    assert link.drop_link


def test_a_slowdown_multiplies_every_later_step_and_outlasts_the_period(monkeypatch):
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = iter([10.0, 10.0, 10.5, 10.5, 11.0, 11.0, 30.0, 30.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    rank = faults.RankFaults(faults.parse([{"kind": "slowdown", "round": 0, "factor": 3}]))
    rank.at_step(0, 0)  # fires; no step measured yet
    rank.at_step(0, 1)  # step 0 took 0.5 s: sleep 2 x 0.5
    rank.at_step(0, 2)
    rank.start_period()  # the gap between periods is not a step
    rank.at_step(1, 0)  # uses the last step's 0.5 s
    assert slept == [0.0, 1.0, 1.0, 1.0]


def test_in_decoupled_mode_a_replica_fault_fires_in_the_first_period_at_or_after_its_merge():
    """A replica merged every other merge launches periods at merge 0, 2, 4: a fault at merge 1
    fires in its period of merge 2 (an exact match would never come), and only once."""
    plan = faults.parse([{"kind": "nan", "replica": 0, "round": 1, "step": 2}])
    rank = faults.RankFaults(plan, at_or_after=True)
    assert [rank.at_step(0, 2), rank.at_step(2, 2), rank.at_step(4, 2)] == [False, True, False]
    assert faults.RankFaults(plan).at_step(2, 2) is False  # synchronous rounds match exactly


@pytest.mark.parametrize(
    "entry, mode, says",
    [
        ({"kind": "kill", "round": 0, "step": 4}, "sync", "fault_plan[0].step: 4 is never reached"),
        ({"kind": "kill", "round": 0, "step": 4}, "decoupled", "fault_plan[0].step: 4 is never reached"),
        ({"kind": "nan", "round": 0, "rank": 1}, "decoupled", "fault_plan[0].rank: replica 0 has 1 rank(s)"),
        ({"kind": "kill", "target": "server", "round": 3}, "sync", "fault_plan[0].round: 3 is never reached"),
    ],
)
def test_a_fault_that_could_never_fire_is_refused(tmp_path, entry, mode, says):
    from conftest import tiny_config

    with pytest.raises(ConfigError, match=__import__("re").escape(says)):
        tiny_config(tmp_path, sync_mode=mode, max_steps=4, diloco_loops=3, fault_plan=[entry])
    tiny_config(tmp_path, sync_mode="decoupled", diloco_loops=3, fault_plan=[{"kind": "kill", "round": 7}])  # a merge
