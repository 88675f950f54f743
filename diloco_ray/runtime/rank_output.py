"""What a rank does with the global weights outside its rounds: evaluate them, write ``final/``
with a merged adapter, and describe itself for tests and reports.

Eval loads the servers' exact fp32 weights into the rank's model (keeping its own local
rows aside and putting them back after), so a streaming replica's training state is not
disturbed; the loss is summed over the eval set's loss tokens on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from diloco_ray.algo import compression, loss, partition
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config.sections import DataSection, EvalSection
from diloco_ray.data import plan as data
from diloco_ray.data.samples import TokenData
from diloco_ray.model import loading as modeling
from diloco_ray.runtime.rank_state import local_rows
from diloco_ray.runtime.transport import resolve


@dataclass(frozen=True, kw_only=True, eq=False)
class RankOutput:
    """What one rank does with the global weights: eval, the final save, a description.

    Built once by the rank, every field named.

    Args:
        evaluation: how many eval batches (``eval_batches``).
        batching: how a batch is cut (``batch_size`` rows, ``dynamic_batch`` padding).
        model: the rank's model (compiled or not), whose rows eval overwrites for a while.
        params: its trained parameters, ``(name, parameter)`` in model order.
        sync: the rank's :class:`~diloco_ray.algo.rank_sync.RankSync` (which rows it holds).
        tokens: the job's tokens (eval samples).
        tokenizer: the job's tokenizer (saved with the model).
        fresh_model: builds an unsharded copy of the starting model, for the final save.
        rank: this rank's index inside the replica.
        world_size: ranks in the replica.
        device: where the model lives.
        streamed: local weights may differ from the global ones (then eval puts them back).
        autocast: the mixed-precision context a forward runs in.
    """

    evaluation: EvalSection
    batching: DataSection
    model: torch.nn.Module
    params: list
    sync: RankSync
    tokens: TokenData
    tokenizer: Any
    fresh_model: Callable[[], torch.nn.Module]
    rank: int
    world_size: int
    device: torch.device
    streamed: bool
    autocast: Callable[[], ContextManager]

    @torch.no_grad()
    def evaluate(self, weights: list) -> tuple[float, int, int]:
        """Summed token loss, loss-token count over this rank's share of the eval batches, and
        the bytes of ``weights`` it read, for the global weights ``weights`` (one packed
        buffer or ref per server). The rank's own training state is left as it was.

        Every rank runs the same number of forwards (FSDP's collectives need it); a rank
        with no batch left scores a repeat with weight 0.
        """
        kept = (
            {n: t.detach().to("cpu", copy=True) for n, t in local_rows(self.params).items()} if self.streamed else None
        )
        buffers = resolve(weights)
        self._copy_in(buffers)
        try:
            return (*self._evaluate(), sum(b.nbytes for b in buffers))
        finally:
            if kept is not None:
                for n, t in local_rows(self.params).items():
                    t.copy_(kept[n])

    @torch.no_grad()
    def _copy_in(self, buffers: list) -> None:
        """Overwrite this rank's rows with the weights in ``buffers`` (anchor untouched)."""
        local = local_rows(self.params)
        for buf in buffers:
            pieces, _ = compression.unpack_pieces(buf, self.sync.names)
            for name, (start, piece) in pieces.items():
                span = (start, start + partition.num_rows(piece.shape))
                held = self.sync.held[name]
                mine = partition.intersect({name: span}, {name: held}).get(name)
                if mine is not None:
                    partition.take(local[name], mine, held[0]).copy_(partition.take(piece, mine, start))

    def _evaluate(self) -> tuple[float, int]:
        """(summed token loss, loss tokens) over this rank's eval batches: the driver
        divides the sums over all ranks, a per-token mean as in training."""
        eval_batches, batch_size = self.evaluation.eval_batches, self.batching.batch_size
        self.model.eval()
        evals = self.tokens.eval
        mine = data.eval_batches_for_rank(len(evals), eval_batches, batch_size, self.rank, self.world_size)
        per_rank = -(-eval_batches // self.world_size)
        total, count = 0.0, 0
        for i in range(per_rank):
            real = i < len(mine)
            idx = mine[i] if real else np.arange(min(batch_size, max(1, len(evals))))
            if len(evals) == 0:
                break
            batch = {k: v.to(self.device) for k, v in evals.batch(idx, self.batching.dynamic_batch).items()}
            with self.autocast():
                mean = self.model(**batch).loss
            if real:
                n = loss.loss_tokens(batch["labels"])
                total, count = total + float(mean) * n, count + n
        return total, count

    def save_final(self, weights: list, path: str, merged_path: str | None = None) -> str:
        """Write the global weights (one packed buffer or ref per server) as a Hugging
        Face model folder (rank 0 only): the model, or with PEFT its adapter, plus the
        merged model at ``merged_path``."""
        if self.rank == 0:
            from diloco_ray.runtime.server_group import assemble_weights

            shapes = {n: tuple(p.shape) for n, p in self.params}
            full = {n: torch.from_numpy(w) for n, w in assemble_weights(resolve(weights), shapes).items()}
            # An unsharded copy of the starting model supplies what DiLoCo does not train
            # (frozen weights, buffers); the global weights overwrite the rest.
            from diloco_ray.persist import staging

            model = self.fresh_model()
            modeling.save_hf(model, self.tokenizer, full, staging.scratch(path))
            staging.publish_tree(path)
            if merged_path is not None:
                modeling.save_merged(model, self.tokenizer, staging.scratch(merged_path))
                staging.publish_tree(merged_path)
        return path

    def describe(self) -> dict:
        """What this rank actually built (for tests and debugging)."""
        module = getattr(self.model, "_orig_mod", self.model)
        return {
            "compiled": module is not self.model,
            "attn_implementation": getattr(module.config, "_attn_implementation", None),
            "gradient_checkpointing": bool(
                getattr(module, "is_activation_checkpointing", getattr(module, "is_gradient_checkpointing", False))
            ),
            "trained": {n: tuple(p.shape) for n, p in self.params},
            "frozen": sum(p.numel() for p in module.parameters() if not p.requires_grad),
            "train_samples": len(self.tokens.train),
        }
