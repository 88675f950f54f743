"""The driver end to end on a local Ray (CPU, gloo): rounds, FSDP inside replicas, the
outer update the server applies, a rank lost inside an FSDP replica, step events, bf16.
(Scaling: test_faults.py; a rejected NaN pseudo-gradient: test_chaos.py, test_fault_kinds.py.)"""

import glob
import math
import os
import sys

import pytest
import ray
import torch
from conftest import model_parts, tiny_config
from safetensors.torch import load_file

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.algo import compression
from diloco_ray.observe.metrics import read_events
from diloco_ray.outer import OuterOptimizer
from diloco_ray.runtime.server import ParameterServer, resolve

pytestmark = pytest.mark.integration

# The fakes below live in this test module, which Ray workers cannot import by name.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RecordingServer(ParameterServer):
    """Keeps every rank's pieces it was sent, so the test can redo the outer step itself."""

    def prepare(self, fragment, contributions, divisor=None, scale=None):
        self.recorded = [
            (c.replica_id, c.weight, [compression.unpack_pieces(b, self.layout.names)[0] for b in resolve(c.refs)])
            for c in contributions
        ]
        return super().prepare(fragment, contributions, divisor, scale)

    def get_recorded(self):
        return self.recorded


class RecordingTrainer(DilocoFSDPTrainer):
    server_cls = RecordingServer


def test_fsdp_replicas_round_equals_outer_optimizer_then_a_rank_dies_mid_round(ray_local, tmp_path):
    """Round 0 of two 2-rank FSDP replicas is exactly the outer optimizer over their
    pseudo-gradients. Then the last rank of replica 1 dies at inner step 1 of round 2: the
    survivor of its replica is blocked in a collective, and the driver must not wait for it
    (no round_timeout_s is set). Round 2 is applied with replica 0, and a replacement joins
    for round 3. (A one-rank replica killed: test_fault_kinds.py, both modes.)"""
    kill = {"kind": "kill", "replica": 1, "rank": 1, "round": 2, "step": 1}
    cfg = tiny_config(
        tmp_path / "run",
        ranks_per_replica=2,
        diloco_loops=4,
        max_steps=3,
        outer_grad_clip=5.0,
        min_replicas=1,
        join_timeout_s=120,
        fault_plan=[kill],
    )
    trainer = RecordingTrainer(cfg)
    trainer.setup()
    try:
        before = trainer.global_weights()
        first = trainer.run_round()
        recorded = ray.get(trainer.server.actors[0].get_recorded.remote())
        after = trainer.global_weights()

        assert first["replicas"] == 2 and first["dropped"] == []
        # Every rank built the seeded weights (equal digests): nothing came down in round 0,
        # and the pseudo-gradients below are still exactly against them.
        assert first["bytes_down"] == 0
        pseudo_grads, weights = [], []
        for _, weight, rank_pieces in recorded:
            assert len(rank_pieces) == 2  # each FSDP rank sent its own rows
            full = {}
            for name, value in before.items():
                rows = [pieces[name] for pieces in rank_pieces]
                want = [c.shape[0] for c in torch.chunk(torch.from_numpy(value), 2, dim=0)]
                assert [r.shape[0] for _, r in rows][: len(want)] == want
                assert [start for start, _ in rows] == [0, want[0]]  # rank r sent rows chunk r
                full[name] = torch.cat([r for _, r in rows])
            pseudo_grads.append(full)
            weights.append(weight)
        # Weighted by loss tokens: a packed sequence predicts seq_len - 1 of its tokens.
        assert weights == [float(cfg.sequences_per_replica_round * (cfg.seq_len - 1))] * 2

        expected = OuterOptimizer({n: torch.from_numpy(w) for n, w in before.items()}, cfg).step(pseudo_grads, weights)
        for name, value in after.items():
            torch.testing.assert_close(torch.from_numpy(value), expected[name], rtol=0, atol=1e-6)

        later = [trainer.run_round() for _ in range(3)]
        assert later[0]["bytes_down"] > 0  # the first update comes down
        assert later[1]["replica_ids"] == [0] and later[1]["dropped"] == [1]
        assert sorted(later[2]["replica_ids"]) == [0, 2]  # a replacement joined
        events = read_events(cfg.output_dir, "membership")
        assert {"action": "leave", "replica_id": 1} in [{k: e[k] for k in ("action", "replica_id")} for e in events]
        assert all(math.isfinite(r["eval_loss"]) for r in later)
        assert later[-1]["eval_loss"] < first["eval_loss"]
        assert later[-1]["train_loss"] < first["train_loss"]
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("sync", [{}, {"sync_fragments": 2, "num_param_servers": 2}], ids=["plain", "streaming"])
def test_one_replica_outer_sgd_lr1_equals_plain_loop(ray_local, tmp_path, sync):
    """DiLoCo with one replica and outer SGD(lr=1, momentum=0) is the plain inner loop;
    so is Streaming DiLoCo (each fragment's sync hands the replica its own weights back),
    whichever server owns which rows. A fragment's global weights are the replica's as of
    that fragment's last sync (step floor((k+1) H / F) of the last round)."""
    from diloco_ray.algo import partition
    from diloco_ray.algo.inner_schedule import inner_lr_at, sync_period
    from diloco_ray.algo.optimizers import build_inner_optimizer
    from diloco_ray.data import plan as data
    from diloco_ray.data import samples, tokenization
    from diloco_ray.model import loading as modeling

    cfg = tiny_config(
        tmp_path / "run",
        num_replicas=1,
        outer_lr=1.0,
        outer_momentum=0.0,
        diloco_loops=3,
        max_steps=4,
        eval_batches=0,
        **sync,
    )
    result = DilocoFSDPTrainer(cfg).train()
    assert [r["round"] for r in result.rounds] == [0, 1, 2]
    got = load_file(os.path.join(result.final_path, "model.safetensors"))

    torch.set_num_threads(1)
    tok = tokenization.load_tokenizer(cfg.sections().model)
    tokens = samples.load_token_data(cfg.sections().data, tok)
    model = modeling.build_model(*model_parts(cfg), tok)
    params = [p for _, p in modeling.trained_parameters(model)]
    opt = build_inner_optimizer(params, cfg.sections().inner_optim)
    named = modeling.trained_parameters(model)
    fragments = partition.fragments({n: tuple(p.shape) for n, p in named}, cfg.sync_fragments)
    last_sync = [sync_period(k, cfg.max_steps, cfg.sync_fragments)[1] for k in range(cfg.sync_fragments)]
    synced = [None] * cfg.sync_fragments  # the reference weights at each fragment's last sync
    for r in range(cfg.diloco_loops):
        start = r * cfg.sequences_per_replica_round
        plan = [(start, cfg.sequences_per_replica_round)]
        for t, micro in enumerate(data.rank_batches(plan, cfg.sections().data, 0, len(tokens.train))):
            for g in opt.param_groups:
                g["lr"] = inner_lr_at(r * cfg.max_steps + t, cfg.sections().inner_optim)
            for idx in micro:
                ids = torch.from_numpy(tokens.train.input_ids[idx])
                (model(input_ids=ids, labels=ids).loss / len(micro)).backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for k, step in enumerate(last_sync):
                if t + 1 == step:
                    synced[k] = {n: p.detach().clone() for n, p in named}
    for k, rows in enumerate(fragments):
        for name, interval in rows.items():
            torch.testing.assert_close(
                partition.take(got[name], interval), partition.take(synced[k][name], interval), rtol=0, atol=1e-5
            )
    shapes = {n: tuple(t.shape) for n, t in got.items()}
    assert sum(partition.numel(rows, shapes) for rows in fragments) == sum(t.numel() for t in got.values())


def test_step_events_reach_metrics_trackers_and_callbacks(ray_local, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Hooks:
        def __init__(self):
            self.calls = []

        def on_train_begin(self, trainer):
            self.calls.append(("begin", trainer.round_index))

        def on_round_begin(self, trainer, round_index, replicas):
            self.calls.append(("round", round_index, replicas))

        def on_step(self, trainer, event):
            self.calls.append(("step", event["round"], event["replica"], event["step"]))

        def on_round_end(self, trainer, record):
            self.calls.append(("end", record["round"]))

        def on_train_end(self, trainer):
            self.calls.append(("done",))

    hooks = Hooks()
    cfg = tiny_config(
        tmp_path / "run",
        diloco_loops=2,
        max_steps=4,
        logging_steps=2,
        log_with=["tensorboard", "wandb"],
        wandb_project="diloco-test",
        wandb_tags=["ci"],
    )
    DilocoFSDPTrainer(cfg, callbacks=[hooks]).train()

    steps = read_events(cfg.output_dir, "step")
    assert sorted((e["round"], e["replica"], e["step"]) for e in steps) == [
        (r, rep, s) for r in (0, 1) for rep in (0, 1) for s in (2, 4)
    ]
    for e in steps:
        assert e["global_step"] == e["round"] * 4 + e["step"] and math.isfinite(e["loss"]) and e["lr"] > 0
        assert e["tokens"] > 0
    # Hooks: begin, then per round its begin, its steps, its end; done last.
    kinds = [c[0] for c in hooks.calls]
    assert kinds[0] == "begin" and kinds[-1] == "done"
    for r in (0, 1):
        start, end = hooks.calls.index(("round", r, 2)), hooks.calls.index(("end", r))
        assert sorted(c[2:] for c in hooks.calls[start:end] if c[0] == "step") == [(0, 2), (0, 4), (1, 2), (1, 4)]

    tb = EventAccumulator(os.path.join(cfg.output_dir, "logs"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("inner/replica1/loss")] == [2, 4, 6, 8]
    assert [e.step for e in tb.Scalars("round/eval_loss")] == [0, 1]
    runs = glob.glob(os.path.join(cfg.output_dir, "logs", "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1


def test_bf16_autocast_and_fsdp_mixed_precision_policy_on_cpu(ray_local, tmp_path):
    """bf16 both ways a replica can run it, side by side: replica 0's two ranks under FSDP2's
    MixedPrecisionPolicy (bf16 params, fp32 reduction) over gloo, replica 1's one rank under
    autocast. Both are applied every round (a broken one would be rejected, not hidden)."""
    cfg = tiny_config(tmp_path / "run", ranks_per_replica=[2, 1], mixed_precision="bf16", diloco_loops=2, max_steps=6)
    result = DilocoFSDPTrainer(cfg).train()
    assert all(sorted(r["replica_ids"]) == [0, 1] and not r["rejected"] for r in result.rounds)
    losses = [r["eval_loss"] for r in result.rounds]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    weights = load_file(os.path.join(result.final_path, "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())  # fp32 master weights on the server
