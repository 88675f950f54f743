"""The fault plan: parsing, matching by place and time, refusing what could never fire (no Ray).
Carrying the faults out is tested in tests/unit/runtime/test_injected_faults.py."""

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
        ({"kind": "slowdown", "round": 0, "factor": 2, "seconds": 0.4}, "fault_plan[0].seconds"),
        ({"kind": "slowdown", "round": 0, "seconds": -0.4}, "fault_plan[0].seconds"),
        ({"kind": "scale", "round": 0}, "fault_plan[0].factor"),
        ({"kind": "scale", "round": 0, "factor": 1}, "fault_plan[0].factor"),
        ({"kind": "scale", "round": 0, "factor": float("inf")}, "fault_plan[0].factor"),
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
