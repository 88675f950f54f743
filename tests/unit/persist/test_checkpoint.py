"""Unit tests for diloco_ray.persist.checkpoint: exact state round trips, integrity, retention, resume (no Ray)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from diloco_ray.algo.outer import OuterOptimizer
from diloco_ray.config.sections import OuterOptimSection
from diloco_ray.errors import ConfigError, DataError
from diloco_ray.persist import checkpoint as ckpt
from diloco_ray.persist import state_files

# --------------------------------------------------------------------- helpers


def assert_same(a, b, where="<root>"):
    """Exact structural equality: same types (tuple vs list, int vs str keys), equal tensors."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        got, want = (a.dtype, tuple(a.shape)), (b.dtype, tuple(b.shape))
        assert got == want, f"{where}: {got} != {want}"
        assert torch.equal(a, b), f"{where}: tensor values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{where}: key {k!r} changed type"
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def json_round_trip(state):
    tensors, skeleton = state_files.flatten_state(state)
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
    return state_files.unflatten_state(tensors, skeleton)


def disk_round_trip(tmp_path, state, name="s"):
    files = state_files.save_state(str(tmp_path), name, state)
    assert files == [f"{name}.safetensors", f"{name}.json"]
    return state_files.load_state(str(tmp_path), name)


def outer_cfg(**overrides):
    base = dict(
        outer_lr=0.7,
        outer_momentum=0.9,
        outer_opt="SGD",
        outer_opt_kwargs={},
        outer_lr_schedule=None,
        outer_grad_clip=None,
        outer_momentum_warmup_rounds=0,
        diloco_loops=4,
    )
    base.update(overrides)
    return OuterOptimSection(**base)


def make_ckpt(root, round, payload=None, meta=None):
    """A committed checkpoint holding one small state."""
    tmp = ckpt.begin(str(root), round)
    state_files.save_state(tmp, "global", payload if payload is not None else {"w": torch.full((3,), float(round))})
    return ckpt.commit(tmp, str(root), round, meta if meta is not None else {"round": round})


def flip_byte(path, offset=-1):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


# ------------------------------------------------------ optimizer state round trips


def _step_torch_opt(opt, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["adamw", "sgd_nesterov"])
def test_torch_optimizer_state_survives_disk_and_resumes_bit_identically(tmp_path, kind):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5).to(torch.bfloat16))]

    def build(ps):
        if kind == "adamw":
            return torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)

    opt = build(params)
    for seed in (1, 2):
        _step_torch_opt(opt, params, seed)
    sd = opt.state_dict()
    loaded = disk_round_trip(tmp_path, sd)
    assert_same(sd, loaded)
    assert set(loaded["state"]) == {0, 1}  # int keys, not "0"/"1"
    if kind == "adamw":
        assert loaded["state"][0]["step"].dim() == 0
        assert loaded["state"][1]["exp_avg"].dtype == torch.bfloat16
        assert type(loaded["param_groups"][0]["betas"]) is tuple

    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = build(fresh_params)
    fresh.load_state_dict(loaded)
    _step_torch_opt(opt, params, 3)
    _step_torch_opt(fresh, fresh_params, 3)
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)


def test_outer_optimizer_state_survives_disk_and_resumes_bit_identically(tmp_path):
    torch.manual_seed(0)
    init = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    g = torch.Generator().manual_seed(7)

    def pseudo():
        return [{k: torch.randn(v.shape, generator=g) for k, v in init.items()} for _ in range(2)]

    a = OuterOptimizer(init, outer_cfg())
    for _ in range(2):
        a.step(pseudo(), [1.0, 3.0])
    sd = a.state_dict()
    loaded = disk_round_trip(tmp_path, sd, name="outer")
    assert_same(sd, loaded)
    assert loaded["round"] == 2

    b = OuterOptimizer({k: torch.zeros_like(v) for k, v in init.items()}, outer_cfg())
    b.load_state_dict(loaded)
    last = pseudo()
    a.step(last, [1.0, 3.0])
    b.step(last, [1.0, 3.0])
    assert a.round == b.round == 3
    for k in init:
        assert torch.equal(a.params[k], b.params[k]), k


# -------------------------------------------------------- flatten/unflatten details


def test_int_keys_tuples_scalars_and_none_survive_json():
    state = {
        0: {"x": 1, "y": 2.5, "z": True, "n": None, "s": "hi"},
        "0": [1, (2, 3), []],
        "t": (),
        7: {-1: "neg"},
        "nested": [(0.5, {1: (True,)})],
    }
    out = json_round_trip(state)
    assert_same(state, out)
    assert 0 in out and "0" in out and type(out[7]) is dict and -1 in out[7]
    assert out["nested"][0][1][1] == (True,)
    # A mix of int and str keys keeps its order.
    assert list(out) == [0, "0", "t", 7, "nested"]


def test_non_finite_floats_in_skeleton():
    state = {"a": float("inf"), "b": float("-inf"), "c": float("nan"), "d": -0.0, "e": 1e308}
    tensors, skeleton = state_files.flatten_state(state)
    text = json.dumps(skeleton, allow_nan=False)  # must not need NaN/Infinity literals
    out = state_files.unflatten_state(tensors, json.loads(text))
    assert out["a"] == math.inf and out["b"] == -math.inf and math.isnan(out["c"])
    assert math.copysign(1.0, out["d"]) == -1.0 and out["e"] == 1e308


def test_dict_keys_that_look_like_tags_are_plain_keys():
    state = {"$tensor": "not a tensor", "$float": "inf", "$dict": {"$items": []}}
    assert_same(state, json_round_trip(state))


def test_zero_dim_and_bf16_tensors(tmp_path):
    state = {
        "step": torch.tensor(2.0),
        "i": torch.tensor(5, dtype=torch.int64),
        "bf": torch.randn(2, 3).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "root": torch.tensor(True),
    }
    out = disk_round_trip(tmp_path, state)
    assert_same(state, out)
    assert out["step"].shape == torch.Size([]) and out["i"].dtype == torch.int64


def test_top_level_tensor_and_empty_state(tmp_path):
    t = torch.arange(4.0)
    assert_same(t, disk_round_trip(tmp_path, t, "t"))
    # No tensors at all still writes both files.
    assert disk_round_trip(tmp_path, {"round": 3}, "meta") == {"round": 3}
    assert state_files.load_tensors(str(tmp_path / "meta.safetensors")) == {}


def test_shared_storage_tensors_saved_as_independent_copies(tmp_path):
    base = torch.arange(12.0)
    state = {"a": base, "view": base[2:6], "same": base, "reshaped": base.view(3, 4)}
    out = disk_round_trip(tmp_path, state)
    assert_same(state, out)
    out["a"][0] = 100.0
    assert out["view"][0] == 2.0 and out["same"][0] == 0.0 and out["reshaped"][0, 0] == 0.0
    assert base[0] == 0.0  # the caller's tensor was never touched


def test_non_contiguous_tensors(tmp_path):
    m = torch.arange(20.0).reshape(4, 5)
    state = {"t": m.t(), "strided": m[:, ::2], "expanded": torch.tensor([1.0, 2.0]).expand(3, 2)}
    assert not state["t"].is_contiguous()
    out = disk_round_trip(tmp_path, state)
    assert_same(state, out)


def test_clashing_paths_get_distinct_keys_and_prefix():
    state = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, 0: torch.full((1,), 2.0), "0": torch.full((1,), 3.0)}
    tensors, skeleton = state_files.flatten_state(state, prefix="opt")
    assert len(tensors) == 4 and all(k.startswith("opt.") for k in tensors)
    assert_same(state, state_files.unflatten_state(tensors, json.loads(json.dumps(skeleton))))


def test_unsupported_values_are_rejected_with_their_path():
    with pytest.raises(TypeError, match=r"x\.1"):
        state_files.flatten_state({"x": [1, {2, 3}]})
    with pytest.raises(TypeError, match="key"):
        state_files.flatten_state({(1, 2): 3})
    with pytest.raises(DataError, match="missing"):
        state_files.unflatten_state({}, {"$tensor": "gone"})


def test_load_state_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        state_files.load_state(str(tmp_path), "nope")
    state_files.save_state(str(tmp_path), "s", {"w": torch.ones(2)})
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        state_files.load_state(str(tmp_path), "s")


# ------------------------------------------------------------ begin/commit/verify


def test_commit_writes_manifest_and_verifies(tmp_path):
    root = tmp_path / "ckpts"
    tmp = ckpt.begin(str(root), 3)
    assert os.path.basename(tmp).startswith(".tmp-round-00000003-")
    state_files.save_state(tmp, "global", {"w": torch.ones(2)})
    os.makedirs(os.path.join(tmp, "replicas"))
    state_files.save_state(os.path.join(tmp, "replicas"), "r0", {"step": 4})
    final = ckpt.commit(tmp, str(root), 3, {"inner_steps": 12})
    assert final == os.path.join(str(root), "round-00000003") and not os.path.exists(tmp)
    assert ckpt.verify(final) is None
    man = ckpt.read_manifest(final)
    assert man["format"] == 1 and man["round"] == 3 and man["meta"] == {"inner_steps": 12}
    assert set(man["files"]) == {"global.safetensors", "global.json", "replicas/r0.safetensors", "replicas/r0.json"}
    assert man["files"]["global.json"] == state_files.sha256_file(os.path.join(final, "global.json"))
    # A file the manifest does not list is not part of what was committed.
    (root / "round-00000003" / "notes.json").write_text("{}")
    assert "'notes.json' is in the checkpoint but not listed" in ckpt.verify(final)


def test_flipped_byte_is_named(tmp_path):
    final = make_ckpt(tmp_path, 1)
    flip_byte(os.path.join(final, "global.safetensors"))
    assert ckpt.verify(final) == "checksum mismatch for 'global.safetensors'"


def test_deleted_file_is_named(tmp_path):
    final = make_ckpt(tmp_path, 1)
    os.remove(os.path.join(final, "global.json"))
    reason = ckpt.verify(final)
    assert reason is not None and "global.json" in reason and "missing" in reason


def test_missing_or_broken_manifest(tmp_path):
    final = make_ckpt(tmp_path, 1)
    man = os.path.join(final, "manifest.json")
    open(man, "w").write('{"format": 1, "files": ')
    assert "not valid JSON" in ckpt.verify(final)
    os.remove(man)
    assert "manifest" in ckpt.verify(final)
    with pytest.raises(DataError):
        ckpt.read_manifest(final)


def test_a_manifest_must_list_every_file(tmp_path):
    final = make_ckpt(tmp_path, 1)
    man = os.path.join(final, "manifest.json")
    doc = json.load(open(man))
    json.dump({**doc, "files": {}}, open(man, "w"))
    assert "lists no files" in ckpt.verify(final)
    # A file the manifest does not name (here: all but one) is not part of the commit.
    name, digest = next(iter(doc["files"].items()))
    json.dump({**doc, "files": {name: digest}}, open(man, "w"))
    reason = ckpt.verify(final)
    assert reason is not None and "not listed" in reason
    json.dump(doc, open(man, "w"))
    assert ckpt.verify(final) is None
    open(os.path.join(final, "extra.bin"), "wb").write(b"x")
    assert "'extra.bin' is in the checkpoint but not listed" in ckpt.verify(final)


def test_temp_folders_are_not_listed(tmp_path):
    make_ckpt(tmp_path, 2)
    tmp = ckpt.begin(str(tmp_path), 5)
    state_files.save_state(tmp, "global", {"w": torch.ones(1)})
    assert ckpt.list_checkpoints(str(tmp_path)) == [os.path.join(str(tmp_path), "round-00000002")]
    assert ckpt.verify(tmp) is not None  # no manifest yet


def test_list_sorts_by_round_number(tmp_path):
    for r in (10, 2, 100000000):
        make_ckpt(tmp_path, r)
    names = [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))]
    assert names == ["round-00000002", "round-00000010", "round-100000000"]
    assert ckpt.list_checkpoints(str(tmp_path / "missing")) == []


def test_commit_replaces_existing_round(tmp_path):
    make_ckpt(tmp_path, 4, payload={"w": torch.zeros(2)}, meta={"try": 1})
    final = make_ckpt(tmp_path, 4, payload={"w": torch.ones(2)}, meta={"try": 2})
    assert ckpt.verify(final) is None
    assert ckpt.read_manifest(final)["meta"] == {"try": 2}
    assert torch.equal(state_files.load_state(final, "global")["w"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["round-00000004"]  # nothing left aside


def test_commit_rejects_non_json_meta(tmp_path):
    tmp = ckpt.begin(str(tmp_path), 0)
    with pytest.raises(ValueError, match="meta"):
        ckpt.commit(tmp, str(tmp_path), 0, {"loss": float("nan")})
    assert ckpt.list_checkpoints(str(tmp_path)) == []


def test_renamed_folder_with_other_round_fails_verify(tmp_path):
    final = make_ckpt(tmp_path, 1)
    os.rename(final, os.path.join(str(tmp_path), "round-00000009"))
    assert "round" in ckpt.verify(os.path.join(str(tmp_path), "round-00000009"))


# ------------------------------------------------------------ latest_valid / prune


def test_latest_valid_skips_corrupt_newest(tmp_path):
    paths = [make_ckpt(tmp_path, r) for r in (1, 2, 3)]
    flip_byte(os.path.join(paths[2], "global.json"), 0)
    os.remove(os.path.join(paths[1], "manifest.json"))
    found, skipped = ckpt.latest_valid(str(tmp_path))
    assert found == paths[0]
    assert [p for p, _ in skipped] == [paths[2], paths[1]]
    assert "global.json" in skipped[0][1] and "manifest" in skipped[1][1]
    assert ckpt.latest_valid(str(tmp_path / "none")) == (None, [])


def test_prune_keeps_newest_valid_and_removes_temp(tmp_path):
    paths = [make_ckpt(tmp_path, r) for r in range(5)]
    stale = ckpt.begin(str(tmp_path), 5)
    deleted = ckpt.prune(str(tmp_path), keep=2)
    assert ckpt.list_checkpoints(str(tmp_path)) == paths[3:]
    assert sorted(deleted) == sorted(paths[:3] + [stale])
    assert not os.path.exists(stale)


def test_prune_none_keeps_all_checkpoints_but_removes_temp(tmp_path):
    paths = [make_ckpt(tmp_path, r) for r in range(3)]
    stale = ckpt.begin(str(tmp_path), 3)
    assert ckpt.prune(str(tmp_path), None) == [stale]
    assert ckpt.list_checkpoints(str(tmp_path)) == paths
    with pytest.raises(ValueError):
        ckpt.prune(str(tmp_path), 0)


def test_prune_never_removes_only_valid_one(tmp_path):
    good = make_ckpt(tmp_path, 1)
    bad = [make_ckpt(tmp_path, r) for r in (2, 3)]
    for p in bad:
        flip_byte(os.path.join(p, "global.safetensors"))
    ckpt.prune(str(tmp_path), keep=1)
    assert os.path.isdir(good) and ckpt.verify(good) is None
    assert ckpt.latest_valid(str(tmp_path))[0] == good


def test_prune_counts_only_valid_ones(tmp_path):
    paths = [make_ckpt(tmp_path, r) for r in range(4)]
    flip_byte(os.path.join(paths[3], "global.safetensors"))
    ckpt.prune(str(tmp_path), keep=2)
    assert ckpt.list_checkpoints(str(tmp_path)) == paths[1:3]


# ------------------------------------------------------------------ resolve_resume


def _run_dir(tmp_path, rounds=(1, 2, 3)):
    out = tmp_path / "run"
    root = out / "checkpoints"
    return str(out), str(root), [make_ckpt(root, r) for r in rounds]


def test_resume_from_output_dir(tmp_path):
    out, _, paths = _run_dir(tmp_path)
    assert ckpt.resolve_resume(out) == (os.path.abspath(paths[-1]), [])


def test_resume_from_checkpoints_root(tmp_path):
    _, root, paths = _run_dir(tmp_path)
    flip_byte(os.path.join(paths[-1], "global.safetensors"))
    path, skipped = ckpt.resolve_resume(root)
    assert path == os.path.abspath(paths[1])
    assert skipped == [(os.path.abspath(paths[2]), "checksum mismatch for 'global.safetensors'")]


def test_resume_from_specific_checkpoint(tmp_path):
    _, _, paths = _run_dir(tmp_path)
    assert ckpt.resolve_resume(paths[1] + os.sep) == (os.path.abspath(paths[1]), [])


def test_resume_from_corrupt_specific_falls_back_to_older(tmp_path):
    _, _, paths = _run_dir(tmp_path, rounds=(1, 2, 3, 4))
    os.remove(os.path.join(paths[2], "global.json"))
    flip_byte(os.path.join(paths[1], "global.safetensors"))
    path, skipped = ckpt.resolve_resume(paths[2])
    # Round 4 is newer than the one asked for, so it is never chosen.
    assert path == os.path.abspath(paths[0])
    assert [p for p, _ in skipped] == [os.path.abspath(paths[2]), os.path.abspath(paths[1])]


def test_resume_nothing_valid_is_config_error(tmp_path):
    out, _, paths = _run_dir(tmp_path, rounds=(4,))
    flip_byte(os.path.join(paths[0], "global.safetensors"))
    with pytest.raises(ConfigError) as info:
        ckpt.resolve_resume(out)
    msg = str(info.value)
    assert msg.startswith(f"resume_from: {out!r}") and "no valid checkpoint" in msg
    assert "round-00000004: checksum mismatch for 'global.safetensors'" in msg
    with pytest.raises(ConfigError, match="resume_from.*no valid checkpoint"):
        ckpt.resolve_resume(paths[0])


def test_resume_empty_or_missing_path_is_config_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"resume_from: .*nope.* does not exist"):
        ckpt.resolve_resume(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="resume_from: .*holds no checkpoints"):
        ckpt.resolve_resume(str(tmp_path / "empty"))
