"""How a step's loss is normalised: per token that carries loss, over the whole step.

A step of one replica is ``grad_accum`` micro-batches on each of its FSDP ranks. Its
gradient should be that of one big batch: the sum of every token's loss over the tokens
that carry loss (labels other than -100, after the causal shift), across all of them.
Averaging each micro-batch's own mean instead (``loss / grad_accum``) would weight a
token in a short or mostly-masked micro-batch (padding, completion-only data, dynamic
batches) more than one in a full one; Hugging Face's Trainer avoids the same bias with
``num_items_in_batch``, which its models' loss functions take.

FSDP averages gradients over the replica's ranks (divides their sum by the rank count),
so each rank divides its token-loss sum by ``total / world_size``: the average of the
ranks' gradients is then the sum over every token divided by ``total``.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def loss_tokens(labels: torch.Tensor) -> int:
    """Tokens of a ``[batch, seq]`` label tensor that carry loss in a causal LM (the
    first position predicts nothing: labels are shifted by one)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def items_per_rank(total_tokens: int, world_size: int) -> float:
    """What each rank divides its summed token loss by (``num_items_in_batch``), given
    the step's loss tokens over all micro-batches and ranks: ``total / world_size``, with
    at least one token so a step without any (every completion truncated) adds nothing
    rather than NaN."""
    return max(int(total_tokens), 1) / world_size
