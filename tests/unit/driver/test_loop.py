"""The loop seams, checked on the code: two sibling loops behind one interface, asking the
trainer only what the Host protocol lists."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from conftest import tiny_config

import diloco_ray
from diloco_ray.driver import decoupled_loop, period_jobs, sync_loop
from diloco_ray.driver import loop as loop_module
from diloco_ray.driver.decoupled_loop import DecoupledLoop
from diloco_ray.driver.host import Host
from diloco_ray.driver.loop import OuterLoop, apply_next_update, loop_for
from diloco_ray.driver.policies import MAX_ROUND_RETRIES, Action, RoundOutcome
from diloco_ray.driver.sync_loop import SyncLoop
from diloco_ray.driver.trainer import DilocoFSDPTrainer


def members(protocol) -> set[str]:
    """The names a Protocol declares: its methods, properties and annotated attributes."""
    names = {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names | set(getattr(protocol, "__annotations__", {}))


def test_the_two_loops_are_siblings():
    assert SyncLoop.__bases__ == (object,) and DecoupledLoop.__bases__ == (object,)


@pytest.mark.parametrize("mode, cls", [("sync", SyncLoop), ("decoupled", DecoupledLoop)])
def test_each_loop_implements_the_loop_interface(tmp_path, mode, cls):
    loop = loop_for(tiny_config(tmp_path / "run", sync_mode=mode).sections(), str(tmp_path / "inflight"))
    assert type(loop) is cls
    missing = [name for name in members(OuterLoop) if not hasattr(loop, name)]
    assert missing == []


def test_both_loops_count_their_updates_by_one_name(tmp_path):
    """A round and a merge are both the servers' ``round_index`` (a record's ``round``)."""
    for mode in ("sync", "decoupled"):
        loop = loop_for(tiny_config(tmp_path / mode, sync_mode=mode).sections(), "")
        assert loop.round_index == 0
        assert not hasattr(loop, "merge_index") and not hasattr(loop, "update_index")


def loop_classes() -> list[ast.ClassDef]:
    """Every class in diloco_ray/ with a ``run_round`` method, as source."""
    classes = []
    for path in sorted(Path(diloco_ray.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(f, ast.FunctionDef) and f.name == "run_round" for f in node.body
            ):
                classes.append(node)
    return classes


def test_the_loops_decide_and_never_call_back_into_the_trainer():
    """A loop returns an outcome: no class with a ``run_round`` that returns one recovers the
    servers, reconciles the members or restores anything through its host."""
    callbacks = {"recover_server", "reconcile", "restore"}
    found = []
    for cls in loop_classes():
        returns = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "run_round").returns
        if returns is None or "RoundOutcome" not in ast.unparse(returns):
            continue  # the trainer's own run_round, which carries outcomes out
        for node in ast.walk(cls):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in callbacks and "host" in ast.unparse(node.func.value):
                found.append(f"{cls.name}: {ast.unparse(node.func)}")
    assert {c.name for c in loop_classes()} >= {"SyncLoop", "DecoupledLoop"}
    assert found == []
    assert not callbacks & members(Host)  # the protocol a loop sees does not even offer them


def test_the_trainer_carries_outcomes_out_in_one_place():
    """The trainer's round runs the loop through apply_next_update, the one handler of an
    outcome for both modes, and nothing else in the trainer reads an outcome's action."""
    source = inspect.getsource(DilocoFSDPTrainer)
    assert "apply_next_update(self.loop, self)" in inspect.getsource(DilocoFSDPTrainer.run_round)
    assert "Action." not in source and "run_round(self)" not in source.replace("def run_round(self)", "")
    handlers = {
        name
        for name, f in vars(loop_module).items()
        if inspect.isfunction(f) and f.__module__ == loop_module.__name__ and "Action." in inspect.getsource(f)
    }
    assert handlers == {"apply_next_update", "carry_out"}


class Outcomes:
    """A loop whose every call ends as ``outcomes`` say (the last one repeats)."""

    def __init__(self, *outcomes):
        self.outcomes, self.round_index, self.calls = list(outcomes), 7, 0

    def run_round(self, host):
        self.calls += 1
        return self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]


class Trainer:
    def __init__(self):
        self.did = []

    def reconcile(self):
        self.did.append("reconcile")

    def recover_server(self):
        self.did.append("recover_server")


def test_an_outcome_is_carried_out_and_the_update_goes_on_until_applied():
    record = object()
    loop = Outcomes(
        RoundOutcome(Action.RUN_AGAIN, why="late"),
        RoundOutcome(Action.RECOVER_SERVER, why="a server died"),
        RoundOutcome(Action.PROCEED, record=record),
    )
    trainer = Trainer()
    assert apply_next_update(loop, trainer) is record
    assert trainer.did == ["reconcile", "recover_server", "reconcile"] and loop.calls == 3


@pytest.mark.parametrize(
    "failure",
    [
        RoundOutcome(Action.RUN_AGAIN, why="1 < min_replicas=2 reported"),  # a synchronous round
        RoundOutcome(Action.RUN_AGAIN, why="replica 1's period was lost: failed"),  # a merge
        RoundOutcome(Action.RECOVER_SERVER, why="a server died during the sync"),  # either mode
    ],
)
def test_one_give_up_rule_for_every_failure_in_both_modes(failure):
    loop, trainer = Outcomes(failure), Trainer()
    with pytest.raises(RuntimeError, match=rf"round 7: not applied in {MAX_ROUND_RETRIES + 1} attempts"):
        apply_next_update(loop, trainer)
    assert loop.calls == MAX_ROUND_RETRIES + 1 and len(trainer.did) >= MAX_ROUND_RETRIES


def test_an_applied_update_starts_the_count_again():
    again = RoundOutcome(Action.RUN_AGAIN, why="late")
    loop, trainer = Outcomes(*[again] * MAX_ROUND_RETRIES, RoundOutcome(Action.PROCEED, record="r")), Trainer()
    assert apply_next_update(loop, trainer) == "r"
    loop.outcomes = [*[again] * MAX_ROUND_RETRIES, RoundOutcome(Action.PROCEED, record="s")]
    assert apply_next_update(loop, trainer) == "s"


@pytest.mark.parametrize("module", [sync_loop, decoupled_loop, period_jobs], ids=lambda m: m.__name__)
def test_a_loop_asks_the_trainer_only_what_the_host_protocol_lists(module):
    tree = ast.parse(inspect.getsource(module))
    asked = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "host"
    }
    assert asked and asked <= members(Host)


def test_the_trainer_is_a_host():
    missing = [
        name for name in members(Host) if not hasattr(DilocoFSDPTrainer, name) and name not in ("server", "members")
    ]
    assert missing == []  # (server and members are attributes it sets up)
