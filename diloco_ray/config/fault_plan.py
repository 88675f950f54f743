"""The chaos plan: faults injected at a given place and time, for tests and benchmarks.

In the spirit of torchft's ``EventInjector().fail_at(rank, step)``, ``fault_plan`` in the
config is a list of mappings, each one fault::

    fault_plan:
      - {kind: slow, replica: 1, round: 2, step: 1, seconds: 5}   # a straggler
      - {kind: slowdown, replica: 1, round: 0, factor: 2}          # a 2x slower replica
      - {kind: slowdown, replica: 1, round: 0, seconds: 0.4}       # a fixed pace: longer by that
      - {kind: kill, replica: 0, rank: 1, round: 3, step: 2}      # a rank's process dies
      - {kind: kill, target: server, round: 4}                    # the parameter server dies
      - {kind: nan, replica: 1, round: 1}                         # a poisoned gradient
      - {kind: scale, region: eu, replica: 0, round: 2, factor: 100}  # a region's update x100

``target`` is ``replica`` (the default), ``server`` or ``driver``. A replica fault fires
in rank ``rank`` of replica id ``replica`` when that rank reaches inner step ``step`` of
round ``round``, once (a re-run of the round does not fire it again). Across regions,
``region`` names another region and ``replica`` the replica inside it (0 to its
``replicas`` - 1): the home hands the region its faults with its config, and the region's
agent carries them out as the home does its own (``{kind: nan, region: eu, replica: 1,
round: 0}``):

* ``kill``: the rank's process dies at once (SIGKILL), as on a lost node.
* ``freeze``: the rank's process stops (SIGSTOP) and never answers again.
* ``slow``: each remaining step of that round takes ``seconds`` longer.
* ``slowdown``: from then on, for the rest of the run, every step takes ``factor`` times
  as long (a slower GPU type): the rank sleeps ``factor - 1`` times its last step's time.
  With ``seconds`` instead of ``factor``, every step takes that much longer: a pace no load
  on the machine changes, which tests of timing rules need (a multiple of a computed step
  is a second on a busy machine and milliseconds on a quiet one).
* ``nan``: that step's loss, and so its gradients and the inner optimizer's state, turn NaN.
* ``drop_link``: the rank trains on, but its pseudo-gradient never leaves: it waits until
  the driver gives up on it (the round's deadline, then ``abort_grace_s``).
* ``scale``: that period's pseudo-gradient leaves ``factor`` times what it is (a faulty or
  hostile party's update: 100, or -1 for a sign flip), to rehearse the screening of
  regions' contributions (docs/security.md); on a home replica it is applied as it is.

A ``server`` fault (``kill``; ``index`` picks the server actor) and a ``driver`` fault
(``kill``: SIGKILL, or ``term``: SIGTERM) fire on the driver while round ``round`` runs,
after the replicas have started it.

In decoupled mode (``sync_mode: decoupled``) ``round`` is a merge index: a server or driver
fault fires in that merge once its replicas have started, and a replica fault in the first
period the replica launches at or after that merge (a replica merged every other merge
launches only every other index, so an exact match could never come). Every fault fires in
both modes; a fault that could never fire (a step past ``max_steps``, a rank the replica
does not have, a round past ``diloco_loops`` in a synchronous run) is refused with the
config. This module only parses and matches the plan (pure functions, no signals or
sleeps); :mod:`diloco_ray.runtime.faults` carries the faults out, at named hook points in a
rank's inner loop and in the driver's loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from diloco_ray.errors import ConfigError

# Replica kinds that rehearse what a region sends (a home trusts its own replicas: a scaled
# home replica's update is applied as it is); tests/integration/test_region_screening.py.
REGION_REHEARSALS = ("scale",)
KINDS = {
    "replica": ("kill", "freeze", "slow", "slowdown", "nan", "drop_link", "scale"),
    "server": ("kill",),
    "driver": ("kill", "term"),
}


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    Args:
        kind: what happens (see the module docstring; allowed kinds depend on ``target``).
        round: the 0-based outer round it fires in.
        target: ``replica``, ``server`` or ``driver``.
        replica: the replica id (replica faults).
        rank: the rank inside the replica (replica faults).
        step: the inner step of the round it fires at, 0-based (replica faults).
        seconds: extra seconds per step (``slow``; ``slowdown`` given no ``factor``).
        factor: how many times as long every step takes from then on (``slowdown``); what
            the period's pseudo-gradient is multiplied by (``scale``).
        index: which server actor (server faults).
        region: another region whose replica it hits (replica faults; None: this cluster's).
    """

    kind: str
    round: int
    target: str = "replica"
    replica: int = 0
    rank: int = 0
    step: int = 0
    seconds: float = 0.0
    index: int = 0
    factor: float = 0.0
    region: Optional[str] = None

    @property
    def key(self) -> tuple:
        """Identifies the fault, so it fires once."""
        return (self.target, self.kind, self.round, self.replica, self.rank, self.step, self.index, self.region)


_INT_FIELDS = ("round", "replica", "rank", "step", "index")


def parse(plan: Optional[list]) -> list[Fault]:
    """Faults from the config's ``fault_plan``; a ConfigError names the entry and field."""
    if plan is None:
        return []
    if not isinstance(plan, list):
        raise ConfigError(
            f"fault_plan: {plan!r} is not allowed; expected a list of mappings such as "
            "{kind: kill, replica: 0, round: 1, step: 2}"
        )
    return [_parse_entry(f"fault_plan[{i}]", entry) for i, entry in enumerate(plan)]


def _parse_entry(where: str, entry) -> Fault:
    """One entry of the plan (``where``: its place, for the message)."""
    known = {f.name for f in fields(Fault)}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: {entry!r} is not allowed; expected a mapping with kind and round")
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(known))}")
    target = entry.get("target", "replica")
    if target not in KINDS:
        raise ConfigError(f"{where}.target: {target!r} is not allowed; expected replica, server or driver")
    kind = entry.get("kind")
    if kind not in KINDS[target]:
        raise ConfigError(
            f"{where}.kind: {kind!r} is not allowed for target {target}; expected one of {', '.join(KINDS[target])}"
        )
    region = entry.get("region")
    if region is not None and (target != "replica" or not isinstance(region, str) or not region):
        raise ConfigError(f"{where}.region: {region!r} is not allowed; a replica fault may name a region of `regions`")
    if "round" not in entry:
        raise ConfigError(f"{where}.round: missing; give the 0-based round the fault fires in")
    for name in _INT_FIELDS:
        value = entry.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}.{name}: {value!r} is not allowed; expected a whole number >= 0")
    return Fault(**{**entry, "seconds": _seconds(where, kind, entry), "factor": _factor(where, kind, entry)})


def _seconds(where: str, kind: str, entry: dict) -> float:
    seconds = entry.get("seconds", 0.0)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        raise ConfigError(f"{where}.seconds: {seconds!r} is not allowed; expected a number >= 0")
    if kind == "slow" and not seconds:
        raise ConfigError(f"{where}.seconds: a slow fault needs seconds > 0 (extra seconds per step)")
    if kind == "slowdown" and seconds and "factor" in entry:
        raise ConfigError(f"{where}.seconds: a slowdown takes factor (times as long) or seconds (longer by), not both")
    return float(seconds)


def _factor(where: str, kind: str, entry: dict) -> float:
    factor = entry.get("factor", 0.0)
    paced = kind == "slowdown" and entry.get("seconds") and "factor" not in entry
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if kind == "slowdown" and not paced and not (number and factor > 1):
        raise ConfigError(
            f"{where}.factor: {factor!r} is not allowed; a slowdown needs a factor > 1 (or seconds > 0 a step)"
        )
    finite = isinstance(factor, (int, float)) and not isinstance(factor, bool) and math.isfinite(factor)
    if kind == "scale" and (not finite or factor in (0, 1)):
        raise ConfigError(
            f"{where}.factor: {factor!r} is not allowed; a scale needs a finite number other than 0 and 1"
        )
    return float(factor)


def for_rank(plan: list[Fault], replica_id: int, rank: int) -> list[Fault]:
    """The replica faults aimed at one rank of this cluster (a region's are its own)."""
    return [
        f for f in plan if f.target == "replica" and f.region is None and f.replica == replica_id and f.rank == rank
    ]


def for_region(plan: Optional[list], region: str) -> Optional[list]:
    """The entries of a config's ``fault_plan`` aimed at ``region``'s replicas, as that
    region's own config holds them (``region`` dropped: they are its replicas); None: none."""
    mine = [{k: v for k, v in entry.items() if k != "region"} for entry in plan or () if entry.get("region") == region]
    return mine or None


def due(
    plan: list[Fault],
    round_index: int,
    step: Optional[int] = None,
    fired: frozenset = frozenset(),
    target: str = "replica",
    at_or_after: bool = False,
) -> list[Fault]:
    """The faults of ``target`` that fire now: at ``round_index`` (or, with ``at_or_after``,
    at any round up to it: decoupled mode's first period at or after the fault's merge),
    at inner step ``step`` for replica faults, and not fired before."""
    return [
        f
        for f in plan
        if f.target == target
        and (f.round <= round_index if at_or_after else f.round == round_index)
        and f.key not in fired
        and (step is None or f.step == step)
    ]


def check_reachable(plan: list[Fault], config) -> None:
    """Refuse a fault that could never fire in this job (configured but silently ignored)."""
    regions = {r["name"]: r for r in config.regions or ()}
    for i, fault in enumerate(plan):
        where = f"fault_plan[{i}]"
        if fault.target != "replica":
            pass
        elif fault.region is not None and fault.region not in regions:
            raise ConfigError(
                f"{where}.region: {fault.region!r} is not one of regions ({', '.join(regions) or 'none'})"
            )
        elif fault.region is not None and fault.replica >= int(regions[fault.region]["replicas"]):
            count = int(regions[fault.region]["replicas"])
            raise ConfigError(f"{where}.replica: region {fault.region!r} has replicas 0..{count - 1}")
        elif fault.step >= config.max_steps:
            raise ConfigError(
                f"{where}.step: {fault.step} is never reached; a period runs inner steps 0..{config.max_steps - 1}"
            )
        elif fault.rank >= config.ranks_of(fault.replica):
            raise ConfigError(
                f"{where}.rank: replica {fault.replica} has {config.ranks_of(fault.replica)} rank(s); "
                f"expected 0..{config.ranks_of(fault.replica) - 1}"
            )
        if config.sync_mode == "sync" and fault.round >= config.diloco_loops:
            raise ConfigError(
                f"{where}.round: {fault.round} is never reached; the run has rounds 0..{config.diloco_loops - 1}"
            )
