"""Unit tests for diloco_ray.algo.outer against hand-computed values (no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_ray.algo.aggregate import (
    MEAN_OVERFLOWS,
    NonFiniteError,
    accepted_of,
    add_weighted,
    agree_on_norm,
    check_finite,
    mean_in_place,
    norm_of_parts,
    rejection_of,
    squares_by_part,
    weight_scale,
)
from diloco_ray.algo.outer import (
    OuterOptimizer,
    OuterStepInfo,
    Rejected,
    Rejection,
    find_invalid,
    outer_lr_at,
    outer_momentum_at,
)
from diloco_ray.config.sections import OuterOptimSection
from diloco_ray.errors import ConfigError


def cfg(**overrides) -> OuterOptimSection:
    base = dict(
        outer_lr=0.7,
        outer_momentum=0.9,
        outer_opt="SGD",
        outer_opt_kwargs={},
        outer_lr_schedule=None,
        outer_grad_clip=None,
        outer_momentum_warmup_rounds=0,
        diloco_loops=10,
    )
    base.update(overrides)
    return OuterOptimSection(**base)


def t(*values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=tol)


# --------------------------------------------------------------------- helpers


def weighted_mean(grads, weights):
    """The server's way (algo.aggregate): an fp32 sum of checked parts times their scaled
    weights, then / the total over the same scale."""
    acc = {n: torch.zeros(g.shape) for n, g in grads[0].items()}
    scale = weight_scale(sum(weights))
    for g, w in zip(grads, weights):
        for n, v in g.items():
            add_weighted(acc[n].view(-1), v.reshape(-1).float(), w / scale, n)
    return mean_in_place(acc, sum(weights), scale)


def test_weighted_mean_weights_1_3():
    ga = {"w": t(1.0, 2.0), "b": t(4.0)}
    gb = {"w": t(3.0, -2.0), "b": t(0.0)}
    out = weighted_mean([ga, gb], [1.0, 3.0])
    # w: (1*[1, 2] + 3*[3, -2]) / 4 = [10, -4] / 4; b: (1*4 + 3*0) / 4
    close(out["w"], [2.5, -1.0])
    close(out["b"], [1.0])
    assert out["w"].dtype == torch.float32


def test_a_zero_total_weight_gives_no_mean():
    assert mean_in_place({"w": t(1.0)}, 0.0) == {}


def test_non_finite_values_are_refused_before_they_reach_the_sum():
    acc = torch.zeros(2)
    with pytest.raises(ValueError, match="non-finite values in 'w'"):
        add_weighted(acc, t(1.0, float("nan")), 1.0, "w")
    assert acc.tolist() == [0.0, 0.0]


def test_global_norm_over_all_tensors():
    def norm(tensors):
        return norm_of_parts(squares_by_part(tensors, {n: i for i, n in enumerate(tensors)}, dict.fromkeys(tensors, 0)))

    assert norm({"a": t(3.0), "b": t(4.0)}) == pytest.approx(5.0)
    assert norm({"a": t(1.0, 2.0), "b": t(2.0)}) == pytest.approx(3.0)
    assert norm({}) == 0.0


def test_the_norm_of_parts_does_not_depend_on_their_order():
    parts = [(1, 0, 0.1), (0, 5, 0.2), (0, 0, 1e-17), (2, 0, 3.0)]
    assert norm_of_parts(parts) == norm_of_parts(list(reversed(parts))) == norm_of_parts(sorted(parts))


def test_find_invalid_reasons():
    ref = {"w": torch.zeros(2), "layer.weight": torch.zeros(1)}
    assert find_invalid({"w": t(1.0, 2.0), "layer.weight": t(3.0)}, ref) is None
    nan = find_invalid({"w": t(1.0, 2.0), "layer.weight": t(math.nan)}, ref)
    assert nan == Rejected(Rejection.NON_FINITE, "non-finite values in 'layer.weight'")
    assert find_invalid({"w": t(1.0, 2.0, 3.0), "layer.weight": t(3.0)}, ref) == Rejected(
        Rejection.MALFORMED, "shape mismatch for 'w': got (3,), want (2,)"
    )
    missing = find_invalid({"w": t(1.0, 2.0)}, ref)
    assert missing.reason is Rejection.MALFORMED and "missing key 'layer.weight'" in str(missing)
    extra = {"w": t(1.0, 2.0), "layer.weight": t(3.0), "zzz": t(1.0)}
    assert "unexpected key 'zzz'" in str(find_invalid(extra, ref))


def test_a_checks_error_is_the_rejection_both_paths_report():
    """The servers turn a check's error into a rejection with rejection_of, and find_invalid
    checks values with the same check_finite: one verdict, one detail."""
    assert rejection_of(NonFiniteError("non-finite values in 'w'")) == Rejected(
        Rejection.NON_FINITE, "non-finite values in 'w'"
    )
    assert rejection_of(ValueError("rank 0 sent rows (0, 9) of 'w'")).reason is Rejection.MALFORMED
    with pytest.raises(NonFiniteError) as raised:
        check_finite(t(1.0, math.inf), "w")
    assert find_invalid({"w": t(1.0, math.inf)}, {"w": torch.zeros(2)}) == rejection_of(raised.value)


def test_the_accepted_and_their_divisor():
    weights = {3: 1.0, 1: 2.0, 2: 0.5}
    assert accepted_of([3, 1, 2], weights, {1: "rejected"}) == ([3, 2], 1.5)
    assert accepted_of([3, 1, 2], weights, {1: "rejected"}, divisor=4.0) == ([3, 2], 4.0)
    assert accepted_of([3], {3: 0.0}, {}, divisor=4.0) == ([3], 0.0)  # no weight: no mean, whatever the divisor


def test_a_mean_past_fp32_is_applied_by_no_one():
    finite = agree_on_norm([0, 2], {1: "bad"}, [(0, 0, 9.0), (1, 0, 16.0)])
    assert finite == ([0, 2], 5.0, {1: "bad"})
    assert agree_on_norm([], {1: "bad"}, [(0, 0, 9.0)]) == ([], None, {1: "bad"})
    accepted, norm, rejected = agree_on_norm([0, 2], {1: "bad"}, [(0, 0, math.inf)])
    assert (accepted, norm) == ([], None) and rejected == {1: "bad", 0: MEAN_OVERFLOWS, 2: MEAN_OVERFLOWS}


# --------------------------------------------------------------- SGD semantics


def test_sgd_nesterov_two_steps_by_hand():
    opt = OuterOptimizer({"w": t(1.0, 2.0)}, cfg(outer_lr=0.7, outer_momentum=0.9))
    # Round 1: two replicas average to g1 = [0.5, -1.0].
    # buf = g1; update = g1 + 0.9*buf = [0.95, -1.9]; w = [1 - 0.7*0.95, 2 + 0.7*1.9]
    out = opt.step([{"w": t(0.4, -1.2)}, {"w": t(0.6, -0.8)}], [1.0, 1.0])
    close(out["w"], [0.335, 3.33])
    # Round 2: g2 = [0.2, 0.4]; buf = 0.9*[0.5, -1.0] + g2 = [0.65, -0.5]
    # update = g2 + 0.9*buf = [0.785, -0.05]; w = [0.335 - 0.5495, 3.33 + 0.035]
    out = opt.step([{"w": t(0.2, 0.4)}], [1.0])
    close(out["w"], [-0.2145, 3.365])
    assert opt.round == 2
    assert opt.last_step.applied and opt.last_step.round == 1


def test_sgd_nesterov_off_via_kwargs():
    opt = OuterOptimizer(
        {"w": t(1.0, 2.0)}, cfg(outer_lr=0.7, outer_momentum=0.9, outer_opt_kwargs={"nesterov": False})
    )
    # Plain heavy-ball: round 1 update = buf = [0.5, -1.0] -> w = [1 - 0.35, 2 + 0.7]
    out = opt.step([{"w": t(0.5, -1.0)}], [1.0])
    close(out["w"], [0.65, 2.7])
    # round 2: buf = 0.9*[0.5, -1.0] + [0.2, 0.4] = [0.65, -0.5] -> w = [0.65 - 0.455, 2.7 + 0.35]
    out = opt.step([{"w": t(0.2, 0.4)}], [1.0])
    close(out["w"], [0.195, 3.05])


def test_sgd_lr1_no_momentum_lands_on_local():
    glob = t(1.0, 2.0)
    local = t(0.5, 2.5)
    opt = OuterOptimizer({"w": glob}, cfg(outer_lr=1.0, outer_momentum=0.0))
    out = opt.step([{"w": glob - local}], [3.0])
    close(out["w"], [0.5, 2.5])
    assert torch.equal(glob, t(1.0, 2.0)), "caller's tensor must not be mutated"


def test_returned_params_are_plain_fp32_leaves():
    opt = OuterOptimizer({"w": t(1.0, dtype=torch.bfloat16)}, cfg())
    out = opt.step([{"w": t(0.5)}], [1.0])
    assert out["w"].dtype == torch.float32
    assert out["w"].is_leaf and out["w"].grad is None
    assert set(opt.params) == {"w"}


# -------------------------------------------------------------------- clipping


def test_clip_uses_norm_over_all_params():
    opt = OuterOptimizer({"a": t(0.0), "b": t(0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0, outer_grad_clip=1.0))
    opt.step([{"a": t(3.0), "b": t(4.0)}], [1.0])
    # total norm sqrt(9 + 16) = 5; coef = 1 / (5 + 1e-6); params = -coef * [3, 4]
    coef = 1.0 / (5.0 + 1e-6)
    close(opt.params["a"], [-3.0 * coef])
    close(opt.params["b"], [-4.0 * coef])
    assert opt.last_step.grad_norm == pytest.approx(5.0)


def test_clip_no_scaling_under_limit():
    opt = OuterOptimizer({"a": t(0.0), "b": t(0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0, outer_grad_clip=10.0))
    opt.step([{"a": t(3.0), "b": t(4.0)}], [1.0])
    close(opt.params["a"], [-3.0])
    close(opt.params["b"], [-4.0])
    assert opt.last_step.grad_norm == pytest.approx(5.0)


# ------------------------------------------------------------------- schedules


@pytest.mark.parametrize(
    "schedule, expected",
    [
        # base 0.8, T = 4, r in (0, 1, 3)
        (None, [0.8, 0.8, 0.8]),
        # 0.4 * (1 + cos(pi/4)), 0.4 * (1 + cos(3pi/4)), cos(pi/4) = 0.70710678
        ("cosine", [0.8, 0.4 * 1.70710678, 0.4 * 0.29289322]),
        ("linear", [0.8, 0.6, 0.2]),
        ("polynomial", [0.8, 0.8 * 0.5625, 0.8 * 0.0625]),
    ],
)
def test_outer_lr_at(schedule, expected):
    got = [outer_lr_at(0.8, schedule, r, 4) for r in (0, 1, 3)]
    assert got == pytest.approx(expected, abs=1e-7)


def test_outer_lr_at_unknown_schedule():
    with pytest.raises(ValueError):
        outer_lr_at(0.8, "exponential", 0, 4)
    with pytest.raises(ValueError):
        OuterOptimizer({"w": t(0.0)}, cfg(outer_lr_schedule="exponential"))


def test_schedule_advances_only_on_applied_rounds():
    opt = OuterOptimizer(
        {"w": t(0.0)},
        cfg(outer_lr=0.8, outer_momentum=0.0, outer_lr_schedule="linear", diloco_loops=4),
    )
    opt.step([{"w": t(1.0)}], [1.0])  # r = 0, lr 0.8 -> w = -0.8
    assert opt.last_step.lr == pytest.approx(0.8)
    close(opt.params["w"], [-0.8])
    opt.step([{"w": t(math.nan)}], [1.0])  # rejected: r stays 1
    assert not opt.last_step.applied
    assert opt.last_step.round == 1 and opt.last_step.lr == pytest.approx(0.6)
    assert opt.round == 1
    opt.step([{"w": t(1.0)}], [1.0])  # r = 1, lr 0.6 -> w = -1.4
    assert opt.last_step.lr == pytest.approx(0.6)
    close(opt.params["w"], [-1.4])
    assert opt.round == 2


# ------------------------------------------------------------------- rejection


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_replica_is_excluded(bad):
    opt = OuterOptimizer({"w": t(0.0, 0.0), "v": t(0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0))
    grads = [
        {"w": t(1.0, 2.0), "v": t(3.0)},
        {"w": t(1.0, 2.0), "v": t(bad)},
        {"w": t(4.0, -1.0), "v": t(0.0)},
    ]
    opt.step(grads, [1.0, 5.0, 2.0])
    info = opt.last_step
    assert info.applied and info.accepted == [0, 2] and info.rejected == [1]
    assert info.reasons == {1: Rejected(Rejection.NON_FINITE, "non-finite values in 'v'")}
    # mean of accepted: (1*[1, 2] + 2*[4, -1]) / 3 = [3, 0]; v: (3 + 0) / 3 = 1
    close(opt.params["w"], [-3.0, 0.0])
    close(opt.params["v"], [-1.0])


def test_all_rejected_changes_nothing():
    opt = OuterOptimizer({"w": t(1.0, 2.0)}, cfg())
    out = opt.step([{"w": t(math.nan, 0.0)}, {"w": t(0.0, math.inf)}], [1.0, 1.0])
    close(out["w"], [1.0, 2.0])
    info = opt.last_step
    assert not info.applied and info.grad_norm is None
    assert info.rejected == [0, 1] and set(info.reasons) == {0, 1}
    assert opt.round == 0
    assert opt.state_dict()["optimizer"]["state"] == {}


def test_empty_or_zero_weight_changes_nothing():
    opt = OuterOptimizer({"w": t(1.0)}, cfg())
    opt.step([], [])
    assert not opt.last_step.applied and opt.round == 0
    opt.step([{"w": t(1.0)}], [0.0])
    assert not opt.last_step.applied and opt.round == 0
    close(opt.params["w"], [1.0])


def test_shape_and_key_mismatch_rejected():
    opt = OuterOptimizer({"w": t(0.0, 0.0), "v": t(0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0))
    grads = [
        {"w": t(1.0, 2.0, 3.0), "v": t(1.0)},  # wrong shape
        {"w": t(1.0, 2.0)},  # missing key
        {"w": t(1.0, 2.0), "v": t(1.0), "extra": t(1.0)},  # extra key
        {"w": t(0.5, -0.5), "v": t(2.0)},  # good
    ]
    opt.step(grads, [1.0, 1.0, 1.0, 1.0])
    info = opt.last_step
    assert info.accepted == [3] and info.rejected == [0, 1, 2]
    assert {r.reason for r in info.reasons.values()} == {Rejection.MALFORMED}
    assert str(info.reasons[0]) == "shape mismatch for 'w': got (3,), want (2,)"
    assert "missing key 'v'" in str(info.reasons[1])
    assert "unexpected key 'extra'" in str(info.reasons[2])
    close(opt.params["w"], [-0.5, 0.5])
    close(opt.params["v"], [-2.0])


@pytest.mark.parametrize(
    "grads, weights",
    [
        ([{"w": t(1.0)}], [-1.0]),
        ([{"w": t(1.0)}], [math.nan]),
        ([{"w": t(1.0)}], [math.inf]),
        ([{"w": t(1.0)}], [1.0, 1.0]),
    ],
)
def test_bad_weights_raise(grads, weights):
    opt = OuterOptimizer({"w": t(0.0)}, cfg())
    with pytest.raises(ValueError):
        opt.step(grads, weights)


# ------------------------------------------------------------ optimizer choice


def test_adam_by_name_with_kwargs_and_no_momentum():
    opt = OuterOptimizer(
        {"w": t(1.0, 1.0)},
        cfg(outer_opt="Adam", outer_lr=0.1, outer_momentum=0.9, outer_opt_kwargs={"betas": (0.5, 0.9)}),
    )
    group = opt.state_dict()["optimizer"]["param_groups"][0]
    assert tuple(group["betas"]) == (0.5, 0.9)
    assert "momentum" not in group
    opt.step([{"w": t(0.5, -2.0)}], [1.0])
    # step 1: m = 0.5 g, v = 0.1 g^2; m_hat = g, v_hat = g^2 -> w -= 0.1 * g / (|g| + 1e-8)
    close(opt.params["w"], [1.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1.0 + 0.1 * 2.0 / (2.0 + 1e-8)])


def test_unknown_outer_opt():
    with pytest.raises(ValueError, match="outer_opt"):
        OuterOptimizer({"w": t(0.0)}, cfg(outer_opt="Lion9000"))
    with pytest.raises(ValueError, match="outer_opt"):
        OuterOptimizer({"w": t(0.0)}, cfg(outer_opt="Optimizer"))


# ---------------------------------------------------------------- checkpoints


ROUNDS = [
    [{"w": t(0.5, -1.0), "v": t(0.25)}, {"w": t(0.1, 0.3), "v": t(-0.5)}],
    [{"w": t(0.2, 0.4), "v": t(1.0)}, {"w": t(-0.3, 0.7), "v": t(0.125)}],
    [{"w": t(1.5, -0.2), "v": t(0.0)}, {"w": t(0.6, 0.6), "v": t(2.0)}],
]
WEIGHTS = [[1.0, 3.0], [2.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_state_dict_round_trip_is_bit_identical(opt_name):
    config = cfg(outer_opt=opt_name, outer_lr=0.3, outer_lr_schedule="cosine", diloco_loops=5)
    init = {"w": t(1.0, 2.0), "v": t(-1.0)}

    straight = OuterOptimizer(init, config)
    for g, w in zip(ROUNDS, WEIGHTS):
        straight.step(g, w)

    first = OuterOptimizer(init, config)
    for g, w in zip(ROUNDS[:2], WEIGHTS[:2]):
        first.step(g, w)
    sd = first.state_dict()
    first.step(ROUNDS[2], WEIGHTS[2])  # must not leak into the saved snapshot

    resumed = OuterOptimizer(sd["params"], config)
    resumed.load_state_dict(sd)
    assert resumed.round == 2
    resumed.step(ROUNDS[2], WEIGHTS[2])

    assert resumed.round == straight.round == 3
    for name in init:
        assert torch.equal(resumed.params[name], straight.params[name])
        assert torch.equal(first.params[name], straight.params[name])


def test_load_state_dict_rejects_mismatched_params():
    opt = OuterOptimizer({"w": t(0.0, 0.0)}, cfg())
    other = OuterOptimizer({"w": t(0.0, 0.0, 0.0)}, cfg())
    with pytest.raises(ValueError):
        opt.load_state_dict(other.state_dict())


# -------------------------------------------------------------------- overflow


def test_a_weighted_sum_past_fp32_gives_finite_weights():
    """1e34 times 2e5 tokens is past fp32's range; the mean, 1e34, is not, and clipping takes
    it to norm 1."""
    opt = OuterOptimizer({"w": t(0.0, 0.0, 0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0, outer_grad_clip=1.0))
    out = opt.step([{"w": t(1e34, 0.0, 0.0)}], [2e5])
    assert opt.last_step.applied and opt.last_step.grad_norm == pytest.approx(1e34, rel=1e-6)
    close(out["w"], [-1.0, 0.0, 0.0])


def test_values_near_the_fp32_limit_average_to_their_token_weighted_mean():
    opt = OuterOptimizer({"w": t(0.0, 0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0, outer_grad_clip=1.0))
    opt.step([{"w": t(3e38, -1e38)}, {"w": t(3e38, 3e38)}], [100.0, 300.0])
    # mean: [3e38, (100 * -1e38 + 300 * 3e38) / 400] = [3e38, 2e38]; norm sqrt(13) * 1e38
    assert opt.last_step.applied and opt.last_step.grad_norm == pytest.approx(math.sqrt(13) * 1e38, rel=1e-6)
    close(opt.params["w"], [-3 / math.sqrt(13), -2 / math.sqrt(13)])


def test_a_weight_past_fp32_is_a_share_of_the_total_like_any_other():
    opt = OuterOptimizer({"w": t(0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0))
    opt.step([{"w": t(1.0)}, {"w": t(4.0)}], [1e39, 3e39])
    assert opt.last_step.applied
    close(opt.params["w"], [-3.25])


def test_a_mean_that_is_not_finite_is_a_rejection_not_a_step(monkeypatch):
    """Normalised weights keep the mean of finite values finite; should it still not be
    (forced here), nothing moves and every accepted replica is rejected with the reason."""
    import diloco_ray.algo.outer as outer

    monkeypatch.setattr(outer, "mean_in_place", lambda acc, *args: {n: v.fill_(math.inf) for n, v in acc.items()})
    opt = OuterOptimizer({"w": t(1.0, 2.0)}, cfg(outer_grad_clip=1.0))
    out = opt.step([{"w": t(1.0, 0.0)}, {"w": t(math.nan, 0.0)}, {"w": t(2.0, 0.0)}], [1.0, 1.0, 1.0])
    close(out["w"], [1.0, 2.0])
    info = opt.last_step
    assert not info.applied and info.grad_norm is None and opt.round == 0
    assert info.accepted == [] and info.rejected == [0, 1, 2]
    assert info.reasons[1] == Rejected(Rejection.NON_FINITE, "non-finite values in 'w'")
    for i in (0, 2):
        assert info.reasons[i].reason is Rejection.NON_FINITE and "weighted mean overflows" in str(info.reasons[i])
    assert opt.state_dict()["optimizer"]["state"] == {}


# ---------------------------------------------------------------------- dtypes


def test_bf16_pseudo_grads_accumulate_in_fp32():
    # 128.5 needs 9 significant bits: representable in fp32 but not bf16 (8 bits),
    # so an exact result proves the sum was not done in bf16.
    grads = [{"w": t(256.0, dtype=torch.bfloat16)}, {"w": t(1.0, dtype=torch.bfloat16)}]
    mean = weighted_mean(grads, [1.0, 1.0])
    assert mean["w"].dtype == torch.float32 and mean["w"].item() == 128.5

    opt = OuterOptimizer({"w": t(0.0)}, cfg(outer_lr=1.0, outer_momentum=0.0))
    opt.step(grads, [1.0, 1.0])
    assert opt.last_step.applied and opt.last_step.accepted == [0, 1]
    assert opt.params["w"].dtype == torch.float32 and opt.params["w"].item() == -128.5


def test_last_step_is_outer_step_info():
    opt = OuterOptimizer({"w": t(0.0)}, cfg())
    assert opt.last_step is None
    opt.step([{"w": t(1.0)}], [1.0])
    assert isinstance(opt.last_step, OuterStepInfo)


def test_load_state_dict_by_name_when_param_order_differs():
    """A checkpoint read back in another key order (safetensors sorts keys) must still map
    each momentum buffer to its own parameter."""
    config = cfg(outer_lr=0.7, outer_momentum=0.9)
    params = {"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([3.0])}
    uninterrupted = OuterOptimizer(params, config)
    grads = [{"b": torch.tensor([0.5, -0.5]), "a": torch.tensor([0.25])}]
    uninterrupted.step(grads, [1.0])
    sd = uninterrupted.state_dict()
    reordered = OuterOptimizer({"a": sd["params"]["a"], "b": sd["params"]["b"]}, config)
    reordered.load_state_dict(sd)
    uninterrupted.step(grads, [1.0])
    reordered.step(grads, [1.0])
    for name in params:
        assert torch.equal(reordered.params[name], uninterrupted.params[name])


@pytest.mark.parametrize(
    "outer",
    [dict(outer_opt="SGD", outer_momentum=0.9), dict(outer_opt="Adam", outer_opt_kwargs={"betas": [0.9, 0.95]})],
)
def test_in_place_one_parameter_at_a_time_equals_one_step(outer):
    """The server's way (apply(in_place=True): the sum scaled in place, each parameter
    stepped alone and its gradient dropped) gives the same weights as one step of all."""
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    together = OuterOptimizer({k: v.clone() for k, v in start.items()}, cfg(**outer))
    alone = OuterOptimizer({k: v.clone() for k, v in start.items()}, cfg(**outer))
    for step in range(3):
        mean = {k: torch.randn(v.shape, generator=g) for k, v in start.items()}
        together.apply(mean, lr=0.5, clip_coef=0.3)
        scratch = {k: v.clone() for k, v in mean.items()}
        alone.apply(scratch, lr=0.5, clip_coef=0.3, in_place=True)
        assert scratch == {}  # consumed
        for k in start:
            assert torch.equal(alone.params[k], together.params[k]), (step, k)


def test_outer_momentum_warms_up_linearly_then_holds():
    assert [outer_momentum_at(0.9, 2, r) for r in range(5)] == pytest.approx([0.3, 0.6, 0.9, 0.9, 0.9])
    assert outer_momentum_at(0.9, 0, 0) == 0.9


@pytest.mark.parametrize("kwargs", [{}, {"foreach": False}])  # fused (the default here) and not
def test_sgd_nesterov_under_momentum_warmup_by_hand(kwargs):
    opt = OuterOptimizer(
        {"w": t(1.0)}, cfg(outer_lr=0.5, outer_momentum=0.9, outer_momentum_warmup_rounds=2, outer_opt_kwargs=kwargs)
    )
    # Update 0, momentum 0.3: buf = g = 1; step = g + 0.3 * buf = 1.3; w = 1 - 0.65
    close(opt.step([{"w": t(1.0)}], [1.0])["w"], [0.35])
    # Update 1, momentum 0.6: buf = 0.6 * 1 + 2 = 2.6; step = 2 + 0.6 * 2.6 = 3.56; w = 0.35 - 1.78
    close(opt.step([{"w": t(2.0)}], [1.0])["w"], [-1.43])
    # Update 2 on, momentum 0.9: buf = 0.9 * 2.6 - 1 = 1.34; step = -1 + 0.9 * 1.34 = 0.206
    close(opt.step([{"w": t(-1.0)}], [1.0])["w"], [-1.533])
    close(opt.momentum("w"), [1.34])


def test_momentum_warmup_reaches_the_decoupled_step():
    warm = OuterOptimizer({"w": t(1.0)}, cfg(outer_lr=0.5, outer_momentum=0.9, outer_momentum_warmup_rounds=2))
    # delayed Nesterov at the end of a cycle with beta 0.3 (update 0): as SGD Nesterov's step
    warm.apply_delayed({"w": t(1.0)}, lr=0.5, clip_coef=1.0, cycle_end=True)
    cold = OuterOptimizer({"w": t(1.0)}, cfg(outer_lr=0.5, outer_momentum=0.3))
    cold.apply_delayed({"w": t(1.0)}, lr=0.5, clip_coef=1.0, cycle_end=True)
    torch.testing.assert_close(warm.params["w"], cold.params["w"], rtol=0, atol=0)


@pytest.mark.parametrize("clipped", [False, True])
def test_decoupled_merges_of_a_whole_round_each_are_the_synchronous_steps_under_warmup(clipped):
    """Each merge a whole round (replicas in lockstep, quorum of all): decoupled mode's
    delayed Nesterov is then torch's Nesterov step for step, warm-up included, as in
    tests/integration/test_decoupled_training.py's lockstep run against the synchronous one."""
    step = dict(outer_lr=0.5, outer_momentum=0.9, outer_momentum_warmup_rounds=3)
    sync = OuterOptimizer({"w": torch.zeros(3)}, cfg(**step))
    merged = OuterOptimizer({"w": torch.zeros(3)}, cfg(**step))
    g = torch.Generator().manual_seed(0)
    for r in range(6):
        grad = torch.randn(3, generator=g)
        sync.step([{"w": grad}], [1.0])
        coefs = (1.0, 1.0) if clipped else None  # the cycle's clip coefficients, no clip
        merged.apply_delayed({"w": grad.clone()}, merged.lr_at(r), 1.0, cycle_end=True, cycle_coefs=coefs)
        merged.advance()
        torch.testing.assert_close(merged.params["w"], sync.params["w"], rtol=0, atol=1e-6)


def test_momentum_warmup_needs_an_outer_optimizer_with_a_momentum():
    with pytest.raises(ConfigError, match="outer_momentum_warmup_rounds: Adam has no momentum to warm up"):
        OuterOptimizer({"w": t(1.0)}, cfg(outer_opt="Adam", outer_momentum_warmup_rounds=2))
