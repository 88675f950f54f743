"""Per-token loss normalisation (diloco_ray.algo.loss), on a tiny Llama built from a config:
a step of micro-batches with different numbers of loss tokens must give the gradient
of one big batch's per-token mean, as the rank's inner loop computes it."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diloco_ray.algo.loss import IGNORE_INDEX, items_per_rank, loss_tokens


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def micro_batches():
    """Two micro-batches of 8 tokens: one with loss on 7 positions, one on 2
    (completion-only data: the prompt's labels are masked)."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50, (1, 8), generator=g) for _ in range(2)]
    full = ids[0].clone()
    masked = ids[1].clone()
    masked[:, :6] = IGNORE_INDEX
    return [{"input_ids": ids[0], "labels": full}, {"input_ids": ids[1], "labels": masked}]


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def big_batch_grads():
    model = tiny_llama()
    batches = micro_batches()
    logits = [model(input_ids=b["input_ids"]).logits[:, :-1] for b in batches]
    labels = [b["labels"][:, 1:] for b in batches]
    loss = torch.nn.functional.cross_entropy(
        torch.cat([x.reshape(-1, 50) for x in logits]),
        torch.cat([y.reshape(-1) for y in labels]),
        ignore_index=IGNORE_INDEX,
    )
    loss.backward()
    return grads(model)


def test_loss_tokens_count_the_shifted_labels():
    b = micro_batches()
    assert [loss_tokens(x["labels"]) for x in b] == [7, 2]


def test_a_step_of_micro_batches_equals_one_big_batch():
    want = big_batch_grads()
    model = tiny_llama()
    batches = micro_batches()
    items = items_per_rank(sum(loss_tokens(b["labels"]) for b in batches), world_size=1)
    for b in batches:
        model(**b, num_items_in_batch=items).loss.backward()
    got = grads(model)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6
    # What the loop did before: each micro-batch's own mean, averaged over grad_accum.
    old = tiny_llama()
    for b in batches:
        (old(**b).loss / len(batches)).backward()
    assert max((grads(old)[n] - want[n]).abs().max().item() for n in want) > 1e-3


def test_ranks_split_a_step_and_fsdp_averages_them():
    """Two ranks each hold one micro-batch; FSDP averages their gradients (sum / 2). With
    each dividing by total / world_size, that average is the big batch's gradient."""
    want = big_batch_grads()
    batches = micro_batches()
    total = sum(loss_tokens(b["labels"]) for b in batches)
    per_rank = []
    for b in batches:
        model = tiny_llama()
        model(**b, num_items_in_batch=items_per_rank(total, world_size=2)).loss.backward()
        per_rank.append(grads(model))
    averaged = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in want}
    assert max((averaged[n] - want[n]).abs().max().item() for n in want) < 1e-6


def test_a_step_without_loss_tokens_adds_nothing():
    assert items_per_rank(0, 2) == 0.5
    model = tiny_llama()
    b = micro_batches()[1]
    b["labels"][:] = IGNORE_INDEX
    loss = model(**b, num_items_in_batch=items_per_rank(0, 1)).loss
    assert torch.isfinite(loss) and loss.item() == 0.0


def test_the_inner_loop_gives_grad_accum_the_gradient_of_one_batch(tmp_path):
    """On a rank: 2 micro-batches of 2 prompt/completion pairs of different lengths (loss
    on the completion only, so with different loss-token counts) train exactly as 1 batch
    of 4 does."""
    import json
    import random

    from conftest import first_round, tiny_config

    from diloco_ray.runtime.rank import RankWorker

    rng = random.Random(0)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"q": "q" * rng.randint(1, 12), "a": "a" * rng.randint(1, 12)}) + "\n" for _ in range(64))
    )

    def pseudo_gradient(batch_size, grad_accum):
        cfg = tiny_config(
            tmp_path / f"b{batch_size}",
            batch_size=batch_size,
            grad_accum=grad_accum,
            max_steps=2,
            dataset_name=None,
            dataset_kwargs={},
            json_file_path=str(rows),
            prompt_template="{q}=",
            completion_template="{a}",
            max_grad_norm=None,
        )
        w = RankWorker(cfg.to_dict(), replica_id=0, rank=0, world_size=1)
        w.setup()
        grads, stats = first_round(w, [(0, 8)])
        return grads, stats

    one, one_stats = pseudo_gradient(4, 1)
    two, two_stats = pseudo_gradient(2, 2)
    assert one_stats.loss_tokens == two_stats.loss_tokens > 0
    assert max((one[n] - two[n]).abs().max().item() for n in one) < 1e-5
