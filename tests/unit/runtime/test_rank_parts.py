"""A rank's parts built from the typed sections they read (no Ray, no model): the sync from the
codec section, the batches from the data section, the inner state from the optimiser section."""

import numpy as np
import pytest
import torch

from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import plan as data_plan
from diloco_ray.data.samples import Samples, TokenData
from diloco_ray.runtime.rank_batches import RankBatches
from diloco_ray.runtime.rank_state import RankState

SHAPES = {"w": (6, 4), "b": (6,)}


def config(**kw) -> TrainerConfig:
    fields = dict(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", seq_len=8)
    return TrainerConfig(**{**fields, **kw})


def test_a_rank_sync_built_of_the_codec_section_equals_the_plain_one():
    cfg = config(
        pseudo_grad_compression="int8",
        error_feedback=True,
        error_feedback_decay=0.5,
        compression_block=16,
        sync_fragments=2,
        fragment_alpha=0.25,
        overlap_communication=True,
        num_param_servers=2,
    )
    built = RankSync.of(cfg.sections().sync_codec, SHAPES, world_size=2, rank=1, servers=2)
    plain = RankSync(
        SHAPES, 2, 1, codec=Codec("int8", 16), servers=2, fragments=2, error_feedback=True, alpha=0.25, decay=0.5
    )
    plain.keeps_sent = True
    for attr in ("codec", "alpha", "error_feedback", "keeps_sent", "sends", "held"):
        assert getattr(built, attr) == getattr(plain, attr), attr
    assert built.ledger.decay == plain.ledger.decay == 0.5


def tokens(n: int, seq_len: int = 8) -> TokenData:
    ids = np.arange(n * seq_len, dtype=np.int64).reshape(n, seq_len)
    lengths = np.full(n, seq_len, dtype=np.int64)
    return TokenData(Samples(ids, ids.copy(), lengths), Samples(ids[:0], ids[:0], lengths[:0]))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_batches_cut_a_round_from_the_data_section(rank):
    cfg = config(batch_size=2, grad_accum=2, max_steps=3, ranks_per_replica=2)
    section = cfg.sections().data
    batches = RankBatches(section, tokens(100), rank=rank, world_size=2, device=torch.device("cpu"))
    plan = [(5, cfg.sequences_per_replica_round)]
    source, steps = batches.for_round(0, plan)
    expected = data_plan.rank_batches(plan, section, rank, num_blocks=100)
    assert [[list(m) for m in s] for s in steps] == [[list(m) for m in s] for s in expected]
    assert [len(s) for s in steps] == [2, 2, 2]
    # A replica that ran one step of three leaves two steps' worth of its plan unread.
    assert sum(c for _, c in batches.unused_after(1)) == 2 * data_plan.sequences_per_step(section)
    first = next(batches.micro_batches(source, steps, first=0))
    assert first[:2] == (0, 0) and tuple(first[2]["input_ids"].shape) == (2, 8)


def test_the_inner_state_steps_and_clips_as_its_section_says():
    param = torch.nn.Parameter(torch.zeros(4))
    cfg = config(inner_opt="SGD", inner_opt_kwargs={}, lr=1.0, lr_schedule="constant", max_grad_norm=1.0)
    sync, here = RankSync({"p": (4,)}, 1, 0), (0, 1, torch.device("cpu"))
    state = RankState([("p", param)], sync, cfg.sections().inner_optim, "no", *here, streamed=False)
    assert state.scaler is None
    state.backward((param * torch.tensor([30.0, 40.0, 0.0, 0.0])).sum())
    state.step()
    # The gradient (30, 40) is clipped to norm 1 before a plain SGD step of lr 1.
    assert torch.allclose(param.detach(), torch.tensor([-0.6, -0.8, 0.0, 0.0]))
