"""What a parameter server sends down to replicas: the weights message of each committed
sync, the full weights for a replica that starts out or missed a sync, and the exact
global weights for eval and the final save.

With ``weights_compression`` a sync's message is the compressed change since the last one,
so :class:`WeightsOutbox` tracks what replicas then hold (``held``) and quantisation error
never accumulates; uncompressed, a message is the weights themselves and is rebuilt rather
than kept (a full copy of the slice).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from diloco_ray.algo.codecs import Codec
from diloco_ray.runtime.server_codec import SliceCodec
from diloco_ray.runtime.server_store import SliceStore


class WeightsOutbox:
    """The messages one server sends replicas, and what replicas hold of its rows.

    Args:
        store: the rows, version and fragment the messages carry.
        codec: packs them.
        weights_codec: the codec of a sync's message (``none``: the weights themselves).
    """

    def __init__(self, store: SliceStore, codec: SliceCodec, weights_codec: Codec):
        self.store, self.codec, self.weights_codec = store, codec, weights_codec
        self.held: dict = {}  # what replicas hold, with weights_compression
        self.last_message = np.zeros(0, dtype=np.uint8)  # the latest sync's message, with weights_compression
        self.message_version = 0  # the version the latest message carries

    def reset_held(self) -> None:
        """Replicas hold the weights as they are (they were just seeded or loaded)."""
        if not self.weights_codec.lossless:
            self.held = {n: t.clone() for n, t in self.store.params.items()}

    def restore(self, outer: Mapping, version: int) -> None:
        """What a checkpoint kept (``held``, ``last_message``) of the messages up to ``version``."""
        compressed = not self.weights_codec.lossless
        # `held` tracks what replicas hold only while weights go down compressed; it lives
        # beside the weights (a checkpoint's is read on the host).
        device = self.codec.device
        self.held = {n: t.to(device) for n, t in (outer.get("held") or {}).items()} if compressed else {}
        self.last_message = outer["last_message"].numpy() if "last_message" in outer else np.zeros(0, dtype=np.uint8)
        if compressed and not self.held:
            self.reset_held()
        self.message_version = version

    def exact(self) -> np.ndarray:
        """This slice of the exact fp32 global weights, packed (for eval and final/)."""
        store = self.store
        return self.codec.pack(store.params, store.layout.owned, {"version": store.version})

    def minus(self, delta: Mapping) -> np.ndarray:
        """This slice's exact fp32 weights minus ``delta`` (name -> the rows of it this
        server owns), packed as :meth:`exact`: where one update alone would take them at
        learning rate 1. Changes nothing."""
        store = self.store
        owned = store.layout.owned
        trial = {n: store.layout.rows(store.params, n, iv) - delta[n] for n, iv in owned.items()}
        return self.codec.encode(trial, owned, Codec("none"), {"version": store.version})

    def full(self) -> np.ndarray:
        """Every parameter of this slice as replicas hold it, packed fp32. Changes nothing."""
        store = self.store
        return self.codec.pack(self.held or store.params, store.layout.owned, {"version": store.version})

    def last(self) -> np.ndarray:
        """The latest sync's message again; before any sync, :meth:`full`. A delta message
        depends on what replicas held before it, so that one is kept."""
        store = self.store
        if store.version == 0:
            return self.full()
        if self.weights_codec.lossless:
            return self._weights_of((store.fragment - 1) % store.sync_fragments)
        return self.last_message

    def after_sync(self, fragment: int) -> np.ndarray:
        """The message every replica applies after the sync of ``fragment``: built once per
        committed version, and from then on it is what replicas hold."""
        if self.store.version == self.message_version:
            # The sync committed nothing (a round to run again): there is no new version,
            # so no new message, and `held` must not move (it tracks what replicas hold).
            return self.last()
        self.message_version = self.store.version
        if self.weights_codec.lossless:
            return self._weights_of(fragment)
        return self._delta(fragment)

    def _weights_of(self, fragment: int) -> np.ndarray:
        store = self.store
        meta = {"version": store.version, "fragment": fragment}
        return self.codec.pack(store.params, store.layout.target(fragment), meta)

    def _delta(self, fragment: int) -> np.ndarray:
        """The compressed change of ``fragment``'s rows since what replicas hold, which then
        moves by what they will decode."""
        store, layout = self.store, self.store.layout
        target = layout.target(fragment)
        delta = {n: layout.rows(store.params, n, iv) - layout.rows(self.held, n, iv) for n, iv in target.items()}
        meta = {"delta": True, "fragment": fragment, "version": store.version}
        buf = self.codec.encode(delta, target, self.weights_codec, meta)
        decoded, _ = self.codec.unpack(buf)
        for n, iv in target.items():
            layout.rows(self.held, n, iv).add_(decoded[n][1])
        self.last_message = buf
        return buf
