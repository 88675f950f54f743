"""Unit tests for diloco_ray.config.sections: the typed sections cover the flat config under its
own names, hold its validated values, and are built once (no Ray, no torch)."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import pytest

from diloco_ray.config import Sections, TrainerConfig
from diloco_ray.config.fields import FIELD_NAMES, FIELDS, DerivedValues, _f
from diloco_ray.config.sections import (
    SECTION_CLASSES,
    DataSection,
    InnerOptimSection,
    MembershipSection,
    OuterOptimSection,
    PlacementSection,
    section_of,
)

BASE = dict(
    model_config={"model_type": "llama", "hidden_size": 32},
    tokenizer_name="builtin:char",
    dataset_name="builtin:arithmetic",
)


def make(**overrides) -> TrainerConfig:
    return TrainerConfig(**{**BASE, **overrides})


def section_fields(sections: Sections) -> dict[str, set[str]]:
    """section attribute -> the config field names it carries."""
    return {
        part.name: {f.name for f in dataclasses.fields(getattr(sections, part.name))}
        for part in dataclasses.fields(sections)
    }


def test_every_config_field_sits_in_a_section_under_its_own_name():
    carried = set().union(*section_fields(make().sections()).values())
    assert sorted(set(FIELD_NAMES) - carried) == []
    assert sorted(carried - set(FIELD_NAMES)) == []


def test_a_field_is_shared_only_where_two_parts_read_it():
    owners: dict[str, list[str]] = {}
    for section, names in section_fields(make().sections()).items():
        for name in names:
            owners.setdefault(name, []).append(section)
    shared = {name: sorted(where) for name, where in owners.items() if len(where) > 1}
    assert shared == {
        "diloco_loops": ["inner_optim", "outer_optim", "run"],
        "max_steps": ["checkpointing", "data", "inner_optim", "run"],  # the data plan: max_steps steps
        "num_param_servers": ["checkpointing", "placement"],  # a checkpoint's layout, as resumed
        "output_dir": ["checkpointing", "observability"],
        "overlap_communication": ["checkpointing", "sync_codec"],
        "ranks_per_replica": ["checkpointing", "data", "placement"],  # each rank's share of the plan
        "regions": ["channel", "data", "membership"],  # a region's plan is its replicas' worth; it is a member
        "seed": ["checkpointing", "data", "model"],
        "seq_len": ["data", "model"],  # a built model's positions
        "sync_fragments": ["checkpointing", "sync_codec"],
        "sync_mode": ["checkpointing", "run"],
    }


def test_sections_hold_the_validated_values():
    cfg = make(lr="3e-3", outer_lr=1, log_with="tensorboard", link_mbps=5, outer_opt_kwargs={"nesterov": False})
    sections = cfg.sections()
    assert sections.inner_optim.lr == 3e-3  # the string YAML gave, as validation made it
    assert sections.outer_optim.outer_lr == 1.0 and isinstance(sections.outer_optim.outer_lr, float)
    assert sections.observability.log_with == ["tensorboard"]
    assert sections.sync_codec.link_mbps == 5.0
    assert sections.outer_optim.outer_opt_kwargs == {"nesterov": False}
    for section in dataclasses.fields(sections):
        part = getattr(sections, section.name)
        for f in dataclasses.fields(part):
            assert getattr(part, f.name) == getattr(cfg, f.name), f.name


def test_sections_are_frozen_and_share_nothing_mutable_with_the_config():
    cfg = make(inner_opt_kwargs={"weight_decay": 0.1})
    inner = cfg.sections().inner_optim
    with pytest.raises(dataclasses.FrozenInstanceError):
        inner.lr = 1.0
    cfg.inner_opt_kwargs["weight_decay"] = 0.5  # in place: not a field assignment
    assert inner.inner_opt_kwargs == {"weight_decay": 0.1}


def test_sections_are_built_once_and_again_after_a_field_changes():
    cfg = make()
    first = cfg.sections()
    assert cfg.sections() is first
    cfg.lr = 0.25
    assert cfg.sections() is not first
    assert cfg.sections().inner_optim.lr == 0.25


def test_a_config_pickles_with_its_sections_and_stays_equal():
    cfg = make(outer_lr=0.5)
    cfg.sections()
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg
    assert back.sections() == cfg.sections()
    assert back.to_dict() == cfg.to_dict()  # the cache is no field


def test_a_section_can_be_cut_from_any_object_with_its_names():
    cfg = make(outer_lr=0.3, diloco_loops=7)
    assert section_of(OuterOptimSection, cfg) == cfg.sections().outer_optim
    with pytest.raises(AttributeError):
        section_of(InnerOptimSection, object())


def test_sections_of_a_replica_config():
    cfg = make(ranks_per_replica=[1, 2])
    assert cfg.sections().placement.ranks_per_replica == [1, 2]
    assert cfg.for_replica(1).sections().placement.ranks_per_replica == 2


DERIVED = [name for name in vars(DerivedValues) if not name.startswith("_")]


def answer(holder, name: str):
    """A derived value of ``holder``: a property's value, or a method's for replica ids 0..3."""
    value = getattr(holder, name)
    return [value(rid) for rid in range(4)] if callable(value) else value


@pytest.mark.parametrize("ranks", [2, [1, 3]])
def test_a_section_offers_the_derived_values_of_the_config_from_their_one_definition(ranks):
    cfg = make(num_replicas=3, min_replicas=2, ranks_per_replica=ranks, max_steps=3, grad_accum=2, batch_size=5)
    offered = {}
    for name, kind in SECTION_CLASSES.items():
        for value in DERIVED:
            if value in vars(kind):
                assert vars(kind)[value] is vars(DerivedValues)[value], f"{kind.__name__}.{value} is its own rule"
                offered.setdefault(value, []).append(name)
                if value == "sequences_per_replica_round" and isinstance(ranks, list):
                    continue  # one value per replica: asked per id
                assert answer(getattr(cfg.sections(), name), value) == answer(cfg, value), (name, value)
    assert offered == {
        "replica_bounds": ["membership"],
        "ranks_of": ["data", "placement"],
        "max_ranks": ["placement"],
        "sequences_for": ["data"],
        "sequences_per_replica_round": ["data"],
        "replicas_in": ["data"],
        "region_of": ["data", "channel"],
    }


def test_derived_values():
    cfg = make(num_replicas=3, min_replicas=2, ranks_per_replica=[1, 3], max_steps=3, grad_accum=2, batch_size=5)
    sections = cfg.sections()
    assert sections.membership.replica_bounds == cfg.replica_bounds == (2, 3)
    assert make(min_replicas=3, num_replicas=3, max_replicas=5).replica_bounds == (3, 5)
    assert [sections.placement.ranks_of(i) for i in range(3)] == [1, 3, 1]
    assert sections.placement.max_ranks == 3
    assert sections.data.sequences_for(1) == 3 * 2 * 5 * 3
    with pytest.raises(TypeError):
        sections.data.sequences_per_replica_round
    assert cfg.for_replica(1).sections().data.sequences_per_replica_round == 3 * 2 * 5 * 3


def test_each_section_documents_its_fields_with_their_descriptions():
    for kind in SECTION_CLASSES.values():
        doc = kind.__doc__
        assert doc.splitlines()[0].strip(), kind.__name__  # its purpose comes first
        for f in dataclasses.fields(kind):
            assert f"{f.name}: {FIELDS[f.name].metadata['help']}" in doc, (kind.__name__, f.name)


def test_a_section_has_the_tables_types_and_pickles_on_its_own():
    hints = {f.name: f.type for f in dataclasses.fields(MembershipSection)}
    assert hints["round_timeout_s"] == typing.Optional[float]
    section = make(ranks_per_replica=[1, 2]).sections().placement
    assert isinstance(section, PlacementSection)
    assert pickle.loads(pickle.dumps(section)) == section
    assert pickle.loads(pickle.dumps(make().sections())) == make().sections()
    assert DataSection.__module__ == "diloco_ray.config.sections"


def test_a_field_names_known_sections():
    with pytest.raises(ValueError, match="sections"):
        _f("nowhere", 1, "a field in no section")
    with pytest.raises(ValueError, match="sections"):
        _f((), 1, "a field in no section")
