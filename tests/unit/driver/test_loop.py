"""The loop seams, checked on the code: two sibling loops behind one interface, asking the
trainer only what the Host protocol lists."""

from __future__ import annotations

import ast
import inspect

import pytest
from conftest import tiny_config

from diloco_ray.driver import decoupled_loop, period_jobs, sync_loop
from diloco_ray.driver.decoupled_loop import DecoupledLoop
from diloco_ray.driver.host import Host
from diloco_ray.driver.loop import OuterLoop, loop_for
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


def test_a_round_index_and_a_merge_index_have_their_own_names(tmp_path):
    sync = loop_for(tiny_config(tmp_path / "a").sections(), "")
    merges = loop_for(tiny_config(tmp_path / "b", sync_mode="decoupled").sections(), "")
    assert hasattr(sync, "round_index") and not hasattr(sync, "merge_index")
    assert hasattr(merges, "merge_index") and not hasattr(merges, "round_index")


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
