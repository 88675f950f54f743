"""A replica rejected for NaN trains from the global weights again and is applied in the
next round (sync) or merge (decoupled), in every combination that changes the path a
weights message takes into a rank: one or two fragments, overlapped or not, ``topk`` (with
its error feedback) or uncompressed. Decoupled mode merges whole models without overlap.

One fragment without a codec is test_fault_kinds' ``nan`` run, in each mode. The rule
(docs/faults.md, Faults: ``nan``): the rejected replica starts its next period with a
fresh inner optimizer, no residual and a full load of the global weights, so its next
pseudo-gradient is finite and accepted.
"""

import sys

import numpy as np
import pytest
import ray
from conftest import tiny_config

from diloco_ray import DilocoFSDPTrainer

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

POISON = [{"kind": "nan", "replica": 1, "round": 0, "step": 1}]
# One fragment, uncompressed, is test_fault_kinds' nan run in each mode (same rule).
SYNC_PATHS = [
    dict(sync_fragments=fragments, overlap_communication=overlap, pseudo_grad_compression=codec)
    for fragments, overlap in ((1, False), (2, False), (2, True))  # overlap needs fragments
    for codec in ("none", "topk")
    if (fragments, codec) != (1, "none")
]
PATHS = [("sync", p) for p in SYNC_PATHS] + [
    ("decoupled", dict(sync_mode="decoupled", min_quorum=2, pseudo_grad_compression="topk"))
]


@pytest.mark.parametrize("mode,path", PATHS, ids=[f"{m}-" + "-".join(map(str, p.values())) for m, p in PATHS])
def test_a_replica_rejected_for_nan_is_applied_again_from_the_next_update(ray_local, tmp_path, mode, path):
    # Decoupled runs keep the two replicas in lockstep (min_quorum 2), so "the next merge"
    # is one both replicas are in.
    cfg = tiny_config(
        tmp_path / "run", diloco_loops=2, max_steps=4, eval_every=2, eval_batches=1, fault_plan=POISON, **path
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert rounds[0]["rejected"]["1"].startswith("non-finite"), rounds[0]
    for r in rounds[1:]:
        assert r["rejected"] == {}, (r["round"], r["rejected"])
        assert sorted(r["replica_ids"]) == [0, 1], (r["round"], r["replica_ids"])
    assert np.isfinite(rounds[-1]["eval_loss"])
