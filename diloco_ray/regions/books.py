"""A region's books between syncs, kept by the rank's rules with the rank's code: :class:`RegionBooks`.

A region sends the home one message per sync, the merge of its replicas
(:class:`~diloco_ray.regions.merge.RegionalMerge`), and with a lossy codec it owes
the home what those messages did not carry yet. The books keep that debt exactly as a
rank keeps its own: the same ledger (:class:`~diloco_ray.algo.error_feedback.FeedbackLedger`)
over every row, the same period-start rule for its flags and verdicts, the same round-start
rule for a re-run (:func:`~diloco_ray.runtime.round_start.at_period_start`). Beside the
ledger they hold what a region does for its replicas that the home does for its own:

* a replica the region's merge rejected as non-finite starts its next round fresh (a new
  inner optimizer, every weight reloaded), as the home resets a replica it rejected
  (:func:`~diloco_ray.algo.aggregate.poisoned`);
* the home's **restore directive**: when the home's servers start from a checkpoint (a
  resumed home, a server restored behind the round the replicas were at) or from nothing
  (a new run), every notice says so, once per directive: the region then takes up its own
  part of that checkpoint (its residual, and its replicas' inner state, saved when the home
  checkpointed, :meth:`begin_checkpoint`), or starts fresh, and its replicas reload;
* what an agent restarted into the same run takes up: the ledger as it was saved before the
  last upload (:meth:`save`), the verdicts heard since (a small journal, so a put-back is
  never lost to a restart between a notice and the next save) and the round's start.

Files, never pickle (safetensors and JSON, in the region's ``output_dir``); no Ray.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from diloco_ray import files
from diloco_ray.algo.aggregate import poisoned
from diloco_ray.errors import DataError
from diloco_ray.persist import checkpoint, manifest, state_files
from diloco_ray.regions.merge import RegionalMerge, RegionalMessage
from diloco_ray.regions.wire import Notice
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.round_start import at_period_start

# Each state is NAME.json, written last, naming its NAME-XXXXXXXX.safetensors (replaced whole, never torn).
STATE = "region_state"  # the ledger as the agent last saved it
JOURNAL = "region_verdicts.json"  # the verdicts heard since that save
ROUND_START = "region_round_start"  # the residual at the current round's start (restore_on_retry)
CHECKPOINTS = "checkpoints"  # the region's part of the home's checkpoints, by round
LEDGER = "region_ledger"  # a region checkpoint's residual (beside its replicas' inner state)


@dataclass
class PeriodStart:
    """What the region's replicas start a period with, beside the home's notice.

    Args:
        reset_inner: the replicas whose inner state starts fresh (and reload every weight).
        reload: every replica reloads every weight (the home's servers started from a
            checkpoint or from nothing).
        restore_from: a region checkpoint folder every replica takes its inner state from
            first (None: none).
        note: what the region did with the home's restore directive, in one line (None: nothing).
    """

    reset_inner: set = field(default_factory=set)
    reload: bool = False
    restore_from: Optional[str] = None
    note: Optional[str] = None


class RegionBooks:
    """One region's books.

    Args:
        merge: the region's merge (its ledger is the books' residual).
        folder: the region's ``output_dir``.
        run: what a saved state must belong to (the home's run and this region).
        restore_on_retry: the run's ``restore_on_retry``.
        keep_checkpoints: ``save_total_limit`` (None: keep every region checkpoint).
    """

    def __init__(
        self, merge: RegionalMerge, folder: str, run: str, restore_on_retry: bool, keep_checkpoints: Optional[int]
    ):
        self.merge, self.ledger, self.folder, self.run = merge, merge.ledger, folder, run
        self.restore_on_retry, self.keep_checkpoints = restore_on_retry, keep_checkpoints
        self.poisoned: set[int] = set()  # replicas rejected as non-finite since their last round start
        self.directive: Optional[str] = None  # the home's restore directive last carried out
        self.heard: dict[int, bool] = {}  # verdicts heard since the last save (the journal's)
        # The round's start being written while the replicas train (joined before the books change).
        self.writing: Optional[threading.Thread] = None
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)  # the books are the region's own: nobody else reads or plants them

    # ---- a period ----------------------------------------------------------------------
    def begin(self, notice: Notice, replica_ids: Sequence[int]) -> PeriodStart:
        """Apply a job notice's flags and verdicts to the books, as a rank applies its
        job's (see the module docstring); what the region's replicas start with."""
        self._written()
        start = self._follow(notice.restore, replica_ids)
        verdicts = notice.verdicts
        self._hear(verdicts)
        flags = {"reset_inner": notice.reset_inner, "reset": notice.reset, "restart": notice.restart}
        self.ledger.start_period(**flags, verdicts=verdicts, read=self.merge.read)
        action = at_period_start(notice.period.fragment, notice.restart, self.restore_on_retry)
        if action == "rewind":
            self._rewind(notice.period.round)
        elif action == "note":
            self._note_round_start(notice.period.round)
        if notice.reset_inner:  # the home rejected the region's own message as non-finite
            start.reset_inner |= set(replica_ids)
        if notice.period.fragment == 0:  # a rejected replica starts its next round fresh, as at home
            start.reset_inner |= self.poisoned & set(replica_ids)
            self.poisoned = set()
        return start

    def merge_period(self, fragment: int, contributions: Sequence[Sequence[Contribution]], attempt: int):
        """:meth:`RegionalMerge.merge`; a replica rejected as non-finite is noted for a reset."""
        self._written()
        message: RegionalMessage = self.merge.merge(fragment, contributions, attempt=attempt)
        self.poisoned |= poisoned(message.rejected)
        return message

    @property
    def resets_at_round_start(self) -> bool:
        """Whether a replica starts the region's next round fresh (it was rejected as
        non-finite), and so needs the full weights then: the home is told with the reply."""
        return bool(self.poisoned)

    def settle(self, verdicts: Mapping[int, bool]) -> None:
        """Settle verdicts alone (a checkpoint's save: the flat replicas settle theirs too)."""
        self._hear(dict(verdicts))
        self._written()
        self.ledger.settle(verdicts, self.merge.read)

    # ---- what an agent restarted into the run takes up ------------------------------------
    def save(self) -> None:
        """Save the ledger (its residual and the sends awaiting a verdict) and the restore
        directive carried out last, before an upload: what the upload carries is in the
        books; the journal starts over."""
        self._written()
        self._write(STATE, self.ledger.state_dict(), directive=self.directive)
        if self.heard:  # the journal starts over (an empty one stays as it is)
            self.heard = {}
            files.write_atomic(self._path(JOURNAL), json.dumps({"run": self.run, "heard": []}), mode=0o600)

    def load(self) -> Optional[str]:
        """Take up the state an agent of this run saved, then settle the verdicts it heard
        after; what happened, in one line (None: nothing to take up)."""
        path = self._path(f"{STATE}.json")
        if not os.path.isfile(path):
            return None
        saved = self._read(STATE)
        if saved is None:
            return f"{path} is another run's state; starting with an empty residual"
        doc, state = saved
        self.ledger.load_state_dict(state)
        self.directive = doc.get("directive")
        journal = _read_json(self._path(JOURNAL)) if os.path.isfile(self._path(JOURNAL)) else {}
        if journal.get("run") == self.run:
            self.settle({int(a): bool(ok) for a, ok in journal.get("heard", [])})
        return f"took up the books saved in {path}"

    # ---- the region's part of the home's checkpoints -------------------------------------
    def begin_checkpoint(self, round_index: int) -> str:
        """A temp folder for the region's part of the home's checkpoint of ``round_index``:
        the agent has its replicas save their inner state into it, then :meth:`commit_checkpoint`."""
        return checkpoint.begin(self._path(CHECKPOINTS), round_index)

    def commit_checkpoint(self, tmp: str, round_index: int) -> dict:
        """Add the residual (every unsettled send put back: the books as the checkpoint's
        weights leave them), seal the folder and prune old ones; what the home keeps of it
        in its own checkpoint (an id and the manifest's digest), to hand back on a restore."""
        state_files.save_state(tmp, LEDGER, {"residual": self.ledger.saved_residual(self.merge.read)})
        save_id = uuid.uuid4().hex
        path = checkpoint.commit(tmp, self._path(CHECKPOINTS), round_index, {"region_save": save_id})
        checkpoint.prune(self._path(CHECKPOINTS), self.keep_checkpoints)
        return {"id": save_id, "round": round_index, "digest": state_files.sha256_file(_manifest(path))}

    def checkpoint_for(self, saved: Optional[Mapping]) -> Optional[str]:
        """The region checkpoint the home's ``saved`` names (its id and digest), checked
        whole; None when this region holds none that matches."""
        if not saved:
            return None
        path = self._path(CHECKPOINTS, checkpoint.round_folder_name(int(saved.get("round", -1))))
        if not os.path.isfile(_manifest(path)) or checkpoint.verify(path) is not None:
            return None
        meta = manifest.read_manifest(path).get("meta", {})
        digest = state_files.sha256_file(_manifest(path))
        return path if meta.get("region_save") == saved.get("id") and digest == saved.get("digest") else None

    # ---- the steps above -----------------------------------------------------------------
    def _follow(self, directive: Optional[Mapping], replica_ids: Sequence[int]) -> PeriodStart:
        """Carry out the home's restore directive once: the region's part of the checkpoint
        it names, or a fresh start; every replica reloads."""
        if not directive or directive.get("id") == self.directive:
            return PeriodStart()
        self.directive, self.poisoned = directive["id"], set()
        self._drop_round_start()
        saved = directive.get("save")
        path = self.checkpoint_for(saved)
        if path is None:
            self.ledger.clear()
            why = f"round {saved.get('round')}, of which it holds no part" if saved else "nothing"
            note = f"starts fresh: the home starts from {why}"
            return PeriodStart(reset_inner=set(replica_ids), reload=True, note=note)
        self.ledger.load_state_dict(state_files.load_state(path, LEDGER))
        note = f"took up its part of the home's checkpoint of round {saved['round']}"
        return PeriodStart(reload=True, restore_from=path, note=note)

    def _hear(self, verdicts: dict[int, bool]) -> None:
        """Note ``verdicts`` in the journal before they touch the books (a restarted agent
        settles them again: settling is idempotent)."""
        if not verdicts or not self.merge.error_feedback:
            return
        self.heard.update(verdicts)
        heard = sorted([a, ok] for a, ok in self.heard.items())
        files.write_atomic(self._path(JOURNAL), json.dumps({"run": self.run, "heard": heard}), mode=0o600)

    def _note_round_start(self, round_index: int) -> None:
        """Keep the residual as ``round_index`` starts, for a re-run: written while the
        replicas train (nothing changes the books before the period's merge, which waits)."""
        if self.merge.error_feedback:
            residual = dict(self.ledger.residual)
            self.writing = threading.Thread(
                target=self._write, args=(ROUND_START, residual), kwargs={"round": round_index}
            )
            self.writing.start()

    def _written(self) -> None:
        """Wait until the round's start is on disk, before anything changes the books."""
        if self.writing is not None:
            self.writing.join()
            self.writing = None

    def _rewind(self, round_index: int) -> None:
        """Back to the residual kept at ``round_index``'s start (kept as trained when none was)."""
        self._written()
        saved = self._read(ROUND_START) if os.path.isfile(self._path(f"{ROUND_START}.json")) else None
        if saved is not None and saved[0].get("round") == round_index:
            self.ledger.rewind(saved[1])

    def _drop_round_start(self) -> None:
        self._written()
        self._remove(ROUND_START)

    def _write(self, name: str, state, **facts) -> None:
        """``state`` (tensors and plain values) as ``name-XXXXXXXX.safetensors`` and then
        ``name.json``, which names it with ``facts`` and this run: a reader sees the old
        pair or the new one, never half of one. Older tensor files of ``name`` go."""
        tensors, skeleton = state_files.flatten_state(state)
        tensor_file = f"{name}-{uuid.uuid4().hex[:8]}.safetensors"
        state_files.save_tensors(self._path(tensor_file), tensors)
        doc = {**facts, "run": self.run, "tensors": tensor_file, "skeleton": skeleton}
        files.write_atomic(self._path(f"{name}.json"), json.dumps(doc, allow_nan=False), mode=0o600)
        self._remove(name, keep=tensor_file)

    def _read(self, name: str) -> Optional[tuple[dict, object]]:
        """(the facts, the state) :meth:`_write` left as ``name``; None: another run's."""
        doc = _read_json(self._path(f"{name}.json"))
        if doc.get("run") != self.run:
            return None
        tensors = state_files.load_tensors(self._path(os.path.basename(str(doc.get("tensors")))))
        return doc, state_files.unflatten_state(tensors, doc["skeleton"])

    def _remove(self, name: str, keep: Optional[str] = None) -> None:
        """``name``'s files, but the tensor file ``keep`` (None: the JSON too)."""
        for entry in os.listdir(self.folder):
            ours = entry.startswith(f"{name}-") and entry.endswith(".safetensors")
            if (ours and entry != keep) or (keep is None and entry == f"{name}.json"):
                os.remove(self._path(entry))

    def _path(self, *parts: str) -> str:
        return os.path.join(self.folder, *parts)


def _manifest(path: str) -> str:
    return os.path.join(path, manifest.MANIFEST)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a region state this agent can read ({e})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: not a region state this agent can read (not a JSON object)")
    return doc
