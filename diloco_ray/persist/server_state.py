"""A parameter server's state in a checkpoint: its slice of the weights, its outer optimizer, its counters.

Each server writes and reads its own files, named by its index when there are several:
``global*.safetensors`` (its rows of the weights, loadable on their own), ``outer*`` (the
outer optimizer's state, what replicas hold with ``weights_compression``, the last weights
message) and ``server*.json`` (round, fragment, version, data cursor, shapes). A resume
must use the server count and ``sync_fragments`` the checkpoint was written with; either
mismatch is refused with a message naming the field.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import torch

from diloco_ray.algo.outer import OuterOptimizer
from diloco_ray.data import plan as data
from diloco_ray.errors import ConfigError
from diloco_ray.persist import staging, state_files


def file_names(index: int, count: int) -> tuple[str, str, str]:
    """(weights file, outer-state name, meta file) of server ``index`` of ``count``."""
    if count == 1:
        return "global.safetensors", "outer", "server.json"
    tag = f"{index}-of-{count}"
    return f"global-{tag}.safetensors", f"outer-{tag}", f"server-{tag}.json"


def save(server, where: str) -> dict:
    """Write this server's state into ``where`` (a checkpoint being assembled: a
    folder or a bucket URI): its slice of the weights (``global*.safetensors``,
    loadable on their own), the outer optimizer, and ``server*.json`` (round,
    fragment, cursor, shapes). Returns :func:`staging.publish`'s hashes."""
    folder = staging.scratch(where)
    weights_file, outer_name, meta_file = file_names(server.index, server.count)
    sd = server.optimizer.state_dict()
    whole = {n: server.rows(sd["params"], n, iv).contiguous() for n, iv in server.owned.items()}
    state_files.save_tensors(os.path.join(folder, weights_file), whole)
    outer_files = state_files.save_state(
        folder,
        outer_name,
        {
            "optimizer": sd["optimizer"],
            "round": sd["round"],
            "names": sd["names"],
            "held": server.held,
            "last_message": torch.from_numpy(np.array(server.last_message)),
        },
    )
    with open(os.path.join(folder, meta_file), "w") as f:
        json.dump(
            {
                "round": sd["round"],
                "fragment": server.fragment,
                "version": server.version,
                "round_accepted": None if server.round_accepted is None else sorted(server.round_accepted),
                # Decoupled mode: in-flight plans go back into the saved cursor (their work is
                # not in these weights), so a resumed run trains them again.
                "cursor": server.resume_cursor().to_dict(),
                "sync_mode": server.config.sync_mode,
                "work": server.work,
                "count": server.count,
                "sync_fragments": server.config.sync_fragments,
                "shapes": {n: list(s) for n, s in server.shapes.items()},
            },
            f,
        )
    return staging.publish(where, [weights_file, *outer_files, meta_file])


def read_meta(folder: str, config, index: int = 0) -> dict:
    """Server ``index``'s ``server*.json`` in checkpoint ``folder``, once it is known that
    ``config`` may resume from it: the same ``num_param_servers``, ``sync_fragments`` and
    ``sync_mode``. The driver calls it before Ray starts, so a mismatch is one line and
    nothing in output_dir changes; each server calls it again as it loads.

    Raises:
        ConfigError: naming the field that differs and the value the checkpoint needs.
    """
    count = config.num_param_servers
    meta_file = file_names(index, count)[2]
    if not any(n.startswith("server") and n.endswith(".json") for n in os.listdir(folder)):
        raise ConfigError(
            f"resume_from: checkpoint {folder} holds no parameter-server state (no {meta_file}); "
            "expected a checkpoint that diloco-ray train wrote"
        )
    if not os.path.isfile(os.path.join(folder, meta_file)):
        raise ConfigError(
            f"num_param_servers: {count}, but checkpoint {folder} was not written with "
            f"{count} server(s) (no {meta_file}); resume with the server count it was saved with"
        )
    try:
        with open(os.path.join(folder, meta_file)) as f:
            meta = json.load(f)
    except ValueError as e:
        raise ConfigError(f"resume_from: checkpoint {folder} has a {meta_file} that is not valid JSON ({e})") from None
    saved_count = meta.get("count", count)
    if saved_count != count:
        raise ConfigError(
            f"num_param_servers: {count}, but checkpoint {folder} was written with {saved_count}; "
            "resume with the value it was saved with"
        )
    saved_fragments = meta.get("sync_fragments", 1)
    if saved_fragments != config.sync_fragments:
        raise ConfigError(
            f"sync_fragments: {config.sync_fragments}, but checkpoint {folder} was written "
            f"with {saved_fragments}; resume with the value it was saved with"
        )
    saved_mode = meta.get("sync_mode", "sync")
    if saved_mode != config.sync_mode:
        # The momentum buffers mean different things in the two modes.
        raise ConfigError(
            f"sync_mode: {config.sync_mode}, but checkpoint {folder} was written in "
            f"sync_mode: {saved_mode}; resume with the mode it was saved with"
        )
    return meta


def check_model(folder: str, meta: dict, config) -> None:
    """That ``config`` builds the model whose trained parameters checkpoint ``folder`` holds
    (``meta`` is its :func:`read_meta`): the same names and shapes. Built on the meta
    device in the driver before Ray starts, so another model fails in one line instead of
    every replica failing to load the weights, round after round.

    Raises:
        ConfigError: naming ``resume_from``, the first parameter that differs, and the
            fields that decide the model.
    """
    from diloco_ray.data import tokenization
    from diloco_ray.model import loading

    saved = {n: list(s) for n, s in (meta.get("shapes") or {}).items()}
    with warnings.catch_warnings():
        # Libraries' deprecation notes (peft's wrapping, say): a check says its verdict and nothing else.
        warnings.simplefilter("ignore")
        model = loading.meta_model(config, tokenization.load_tokenizer(config))
    wanted = {n: list(p.shape) for n, p in loading.trained_parameters(model)}
    if wanted == saved:
        return
    name = next(n for n in [*saved, *wanted] if saved.get(n) != wanted.get(n))
    if name not in wanted:
        what = f"'{name}' is in the checkpoint but not in the configured model"
    elif name not in saved:
        what = f"'{name}' of the configured model is not in the checkpoint"
    else:
        what = f"'{name}' is {tuple(saved[name])} there and {tuple(wanted[name])} here"
    raise ConfigError(
        f"resume_from: checkpoint {folder} holds another model ({what}); resume with the model it was "
        "saved with (model_name or model_config, use_peft and its peft_type, lora_r, target_modules)"
    )


def load(server, where: str) -> None:
    """Restore the state :meth:`save` wrote (a folder or a bucket URI)."""
    weights_file, outer_name, meta_file = file_names(server.index, server.count)
    folder = staging.localize(where, [meta_file, weights_file, f"{outer_name}.safetensors", f"{outer_name}.json"])
    meta = read_meta(folder, server.config, server.index)
    server.layout(meta["shapes"])
    loaded = state_files.load_tensors(os.path.join(folder, weights_file))
    params = server.split(loaded)
    outer = state_files.load_state(folder, outer_name)
    server.optimizer = OuterOptimizer(params, server.config.sections().outer_optim)
    server.optimizer.load_state_dict({"params": params, **outer})
    # `held` tracks what replicas hold only while weights go down compressed.
    server.held = dict(outer.get("held") or {}) if server.config.weights_compression != "none" else {}
    server.last_message = outer["last_message"].numpy() if "last_message" in outer else np.zeros(0, dtype=np.uint8)
    if server.config.weights_compression != "none" and not server.held:
        server.reset_held()
    server.fragment, server.version = meta.get("fragment", 0), meta.get("version", 0)
    server.message_version = server.version
    accepted = meta.get("round_accepted")
    server.round_accepted = None if accepted is None else set(accepted)
    server.cursor = data.DataCursor.from_dict(meta["cursor"])
    server.in_flight, server.work = {}, float(meta.get("work", 0.0))
