"""A parameter server's state in a checkpoint: its slice of the weights, its outer optimizer, its counters.

Each server writes and reads its own files, named by its index when there are several:
``global*.safetensors`` (its rows of the weights, loadable on their own), ``outer*`` (the
outer optimizer's state, what replicas hold with ``weights_compression``, the last weights
message) and ``server*.json`` (round, fragment, version, data cursor, shapes). A resume
must use the server count and ``sync_fragments`` the checkpoint was written with; either
mismatch is refused with a message naming the field (:func:`read_meta`, which the driver
also runs before Ray starts, with :func:`check_model`).

:class:`ServerCheckpoint` is the server's checkpoint I/O: it gathers the state of the
server's parts (rows and position, what replicas hold, the data cursor) into one
:class:`SavedServer` and writes it, and reads it back for the server to restore.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from diloco_ray.config.sections import CheckpointSection, ModelSection, PeftSection
from diloco_ray.errors import ConfigError
from diloco_ray.persist import staging, state_files


def file_names(index: int, count: int) -> tuple[str, str, str]:
    """(weights file, outer-state name, meta file) of server ``index`` of ``count``."""
    if count == 1:
        return "global.safetensors", "outer", "server.json"
    tag = f"{index}-of-{count}"
    return f"global-{tag}.safetensors", f"outer-{tag}", f"server-{tag}.json"


@dataclass
class SavedServer:
    """One server's state as a checkpoint holds it.

    Args:
        meta: its ``server*.json``: round, fragment, version, data cursor, shapes, ...
        weights: name -> its rows of the weights (``global*.safetensors``).
        outer: the outer optimizer's state (``optimizer``, ``round``, ``names``), what
            replicas hold (``held``) and the last weights message (``last_message``).
    """

    meta: dict
    weights: dict
    outer: dict


def read_meta(folder: str, checkpointing: CheckpointSection, index: int = 0) -> dict:
    """Server ``index``'s ``server*.json`` in checkpoint ``folder``, once it is known that
    the job (its ``checkpointing`` section) may resume from it: the same
    ``num_param_servers``, ``sync_fragments`` and ``sync_mode``. The driver calls it before
    Ray starts, so a mismatch is one line and nothing in output_dir changes; each server
    calls it again as it loads.

    Raises:
        ConfigError: naming the field that differs and the value the checkpoint needs.
    """
    count = checkpointing.num_param_servers
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
    if saved_fragments != checkpointing.sync_fragments:
        raise ConfigError(
            f"sync_fragments: {checkpointing.sync_fragments}, but checkpoint {folder} was written "
            f"with {saved_fragments}; resume with the value it was saved with"
        )
    saved_mode = meta.get("sync_mode", "sync")
    if saved_mode != checkpointing.sync_mode:
        # The momentum buffers mean different things in the two modes.
        raise ConfigError(
            f"sync_mode: {checkpointing.sync_mode}, but checkpoint {folder} was written in "
            f"sync_mode: {saved_mode}; resume with the mode it was saved with"
        )
    return meta


def check_model(folder: str, meta: dict, model: ModelSection, peft: PeftSection) -> None:
    """That the job's ``model`` and ``peft`` sections build the model whose trained
    parameters checkpoint ``folder`` holds (``meta`` is its :func:`read_meta`): the same
    names and shapes. Built on the meta device in the driver before Ray starts, so another
    model fails in one line instead of every replica failing to load the weights, round
    after round.

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
        built = loading.meta_model(model, peft, tokenization.load_tokenizer(model))
    wanted = {n: list(p.shape) for n, p in loading.trained_parameters(built)}
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


class ServerCheckpoint:
    """Writes and reads one parameter server's state: the parts of
    :class:`~diloco_ray.runtime.server.ParameterServer` gathered into a :class:`SavedServer`.

    Args:
        index: the server's position among the ``num_param_servers``.
        checkpointing: the job's checkpointing section: the server count, ``sync_fragments``
            and ``sync_mode`` a checkpoint records and a resume must match.
    """

    def __init__(self, index: int, checkpointing: CheckpointSection):
        self.index, self.checkpointing = index, checkpointing

    def save(self, where: str, store, outbox, plans) -> dict:
        """Write the server's state into ``where`` (a checkpoint being assembled: a folder or
        a bucket URI): its rows, outer state and position (``store``, a ``SliceStore``), what
        replicas hold and the last message (``outbox``, a ``WeightsOutbox``), and the data
        cursor with in-flight plans given back (``plans``, a ``PlanLedger``). Returns
        :func:`staging.publish`'s hashes."""
        return self._write(where, self.gather(store, outbox, plans))

    def gather(self, store, outbox, plans) -> SavedServer:
        """The server's state as :meth:`save` writes it, in memory (what a region's copy of
        the server starts from: :mod:`diloco_ray.regions.mirror`)."""
        sd = store.optimizer.state_dict()
        layout = store.layout
        weights = {n: layout.rows(sd["params"], n, iv).contiguous() for n, iv in layout.owned.items()}
        outer = {
            "optimizer": sd["optimizer"],
            "round": sd["round"],
            "names": sd["names"],
            "held": outbox.held,
            "last_message": torch.from_numpy(np.array(outbox.last_message)),
        }
        position = store.position()
        meta = {
            "round": sd["round"],
            "fragment": position["fragment"],
            "version": position["version"],
            "round_accepted": position["round_accepted"],
            # Decoupled mode: in-flight plans go back into the saved cursor (their work is
            # not in these weights), so a resumed run trains them again.
            "cursor": plans.resume_cursor().to_dict(),
            "sync_mode": self.checkpointing.sync_mode,
            "work": position["work"],
            "cycle_clip": position["cycle_clip"],
            "count": self.checkpointing.num_param_servers,
            "sync_fragments": self.checkpointing.sync_fragments,
            "shapes": {n: list(s) for n, s in layout.shapes.items()},
        }
        return SavedServer(meta=meta, weights=weights, outer=outer)

    def _write(self, where: str, state: SavedServer) -> dict:
        folder = staging.scratch(where)
        weights_file, outer_name, meta_file = file_names(self.index, self.checkpointing.num_param_servers)
        state_files.save_tensors(os.path.join(folder, weights_file), state.weights)
        outer_files = state_files.save_state(folder, outer_name, state.outer)
        with open(os.path.join(folder, meta_file), "w") as f:
            json.dump(state.meta, f)
        return staging.publish(where, [weights_file, *outer_files, meta_file])

    def load(self, where: str) -> SavedServer:
        """What :meth:`save` wrote (a folder or a bucket URI), once :func:`read_meta` found
        that this job may resume from it; its files are checked against the checkpoint's
        manifest first (:func:`staging.read_checked`)."""
        weights_file, outer_name, meta_file = file_names(self.index, self.checkpointing.num_param_servers)
        names = [meta_file, weights_file, f"{outer_name}.safetensors", f"{outer_name}.json"]
        folder = staging.read_checked(where, names)
        meta = read_meta(folder, self.checkpointing, self.index)
        weights = state_files.load_tensors(os.path.join(folder, weights_file))
        return SavedServer(meta=meta, weights=weights, outer=state_files.load_state(folder, outer_name))
