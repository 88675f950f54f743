"""DilocoFSDPTrainer: the driver that owns the server, the replicas and the round loop.

Each outer round: hand every replica the current global weights (an object ref), let it
run its inner steps on its slice of the data stream, wait for the replicas until the
straggler deadline, have the server apply the pseudo-gradients that arrived, evaluate,
record. Between rounds the driver reconciles the replica count with the target that
:meth:`DilocoFSDPTrainer.scale` sets. The driver only ever holds object refs and small
stats; weights and pseudo-gradients go between replicas and server through Ray's
object store.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from diloco_ray import data
from diloco_ray.config import TrainerConfig
from diloco_ray.errors import ConfigError, UserInputError, unwrap
from diloco_ray.inner import RankWorker
from diloco_ray.metrics import MetricsLogger
from diloco_ray.replica import Replica
from diloco_ray.server import Contribution, ParameterServer

# A round that too few replicas finish is run again; this many times in a row is fatal.
MAX_ROUND_RETRIES = 3
PLACEMENT_TIMEOUT_S = 600.0


@dataclass
class TrainResult:
    """What :meth:`DilocoFSDPTrainer.train` returns.

    Args:
        rounds: round records written to metrics.jsonl, in order.
        output_dir: the run's folder.
        final_path: the Hugging Face model folder (``output_dir/final``).
    """

    rounds: list[dict] = field(default_factory=list)
    output_dir: str = ""
    final_path: str = ""

    @property
    def final_eval_loss(self) -> Optional[float]:
        return self.rounds[-1]["eval_loss"] if self.rounds else None


class DilocoFSDPTrainer:
    """Runs a DiLoCo job on the connected Ray cluster (or a local one).

    Args:
        config: the job.
        callbacks: objects that may define ``on_round_end(trainer, record)``.
        worker_cls: the rank class (tests swap in fakes).
        server_cls: the parameter-server class (likewise).
    """

    def __init__(self, config: TrainerConfig, callbacks: Optional[list] = None,
                 worker_cls: type = RankWorker, server_cls: type = ParameterServer):
        self.config = config
        self.callbacks = list(callbacks or [])
        self.worker_cls, self.server_cls = worker_cls, server_cls
        self.replicas: list[Replica] = []
        self._target = config.num_replicas
        self._lock = threading.Lock()
        self._next_id = 0
        self.round_index = 0      # mirrors the server's round index between rounds
        self.data_position = 0    # likewise its position in the data stream
        self._started_ray = False
        self.server = None
        self.metrics: Optional[MetricsLogger] = None

    # ---- public API -------------------------------------------------------------------
    def scale(self, n: int) -> int:
        """Set the target replica count (clamped to [min_replicas, max_replicas]); it
        takes effect at the next round boundary. Returns the target set. Thread-safe."""
        lo, hi = self.config.replica_bounds
        if not isinstance(n, int) or isinstance(n, bool):
            raise ConfigError(f"scale: {n!r} is not an integer replica count")
        with self._lock:
            self._target = min(max(n, lo), hi)
            return self._target

    @property
    def target_replicas(self) -> int:
        with self._lock:
            return self._target

    def global_weights(self) -> dict:
        """A copy of the current global weights on the driver (name -> numpy array).

        For inspection and tests: the round loop itself never pulls weights here.
        """
        return {n: w.copy() for n, w in ray.get(self._weights_ref).items()}

    def train(self) -> TrainResult:
        """Run ``diloco_loops`` outer rounds; blocks until done. Returns the records."""
        result = TrainResult(output_dir=self.config.output_dir)
        try:
            self.setup()
            while self.round_index < self.config.diloco_loops:
                result.rounds.append(self.run_round())
            result.final_path = self.save_final()
        except RayTaskError as e:
            cause = unwrap(e)
            if isinstance(cause, UserInputError):
                raise cause from None
            raise
        finally:
            self.shutdown()
        return result

    # ---- set-up -----------------------------------------------------------------------
    def setup(self) -> None:
        """Prepare output_dir, connect to Ray, start the server and the replicas."""
        cfg = self.config
        _prepare_output_dir(cfg)
        self._connect_ray()
        self.device = self._resolve_device()
        cfg.to_yaml(os.path.join(cfg.output_dir, "config.yaml"))
        self.metrics = MetricsLogger(cfg.output_dir, cfg.log_with, cfg.log_dir, cfg.to_dict())
        self.server = ray.remote(self.server_cls).options(num_cpus=cfg.server_cpus).remote(cfg.to_dict())
        self._start_replicas(cfg.num_replicas)
        # Every rank builds the same initial model, so replica 0 seeds the global weights.
        seed = self.replicas[0]
        self.weight_bytes = ray.get(self.server.initialize.remote(seed.local_shards(), seed.shapes))
        self.round_index, self.data_position = ray.get(self.server.position.remote())
        self._weights_ref = self.server.weights.remote()

    def _connect_ray(self) -> None:
        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            ray.init()  # join the cluster RAY_ADDRESS names (ray job submit sets it)
            return
        cfg = self.config
        # Logical CPUs, not cores: rank actors reserve cpus_per_rank each, and a laptop
        # with fewer cores than ranks should still run the job (just slower).
        need = cfg.server_cpus + cfg.replica_bounds[1] * cfg.ranks_per_replica * cfg.cpus_per_rank
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need)), include_dashboard=False,
                 log_to_driver=True)
        self._started_ray = True

    def _resolve_device(self) -> str:
        want = self.config.device
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if want == "cuda" and not has_gpu:
            raise ConfigError("device: 'cuda' but the Ray cluster has no GPUs; use device: cpu or auto")
        return "cuda" if want == "cuda" or (want == "auto" and has_gpu) else "cpu"

    def _start_replicas(self, n: int) -> None:
        """Start ``n`` new replicas and wait until they are set up."""
        started = []
        for _ in range(n):
            rep = Replica(self._next_id, self.config, self.device, self.worker_cls)
            self._next_id += 1
            started.append(rep)
        for rep in started:
            rep.wait_placed(PLACEMENT_TIMEOUT_S)
        pending = [(rep, rep.setup()) for rep in started]
        for rep, refs in pending:
            rep.shapes = ray.get(refs)[0]
            self.replicas.append(rep)
            self._log({"event": "membership", "action": "join", "replica_id": rep.id,
                       "round": self.round_index, "replicas": len(self.replicas)})

    # ---- one round --------------------------------------------------------------------
    def run_round(self) -> dict:
        """Run and apply one outer round (retrying if too few replicas report)."""
        for attempt in range(MAX_ROUND_RETRIES + 1):
            record = self._attempt_round()
            if record is not None:
                return record
            self._reconcile()
        raise RuntimeError(f"round {self.round_index}: fewer than min_replicas="
                           f"{self.config.min_replicas} replicas reported in {MAX_ROUND_RETRIES + 1} attempts")

    def _attempt_round(self) -> Optional[dict]:
        cfg = self.config
        t_start = time.perf_counter()
        members = list(self.replicas)
        per_replica = cfg.sequences_per_replica_round
        ranges = data.replica_ranges(self.data_position, len(members), per_replica)
        launched = {rep.id: (rep, *rep.run_round(self._weights_ref, self.round_index, start))
                    for rep, (start, _) in zip(members, ranges)}
        reported, dropped, failed = self._gather(launched, cfg.round_timeout_s)
        for rep in failed:
            self._remove(rep, "failed")
        if len(reported) < cfg.min_replicas:
            return None

        contributions = [Contribution(rid, launched[rid][1], float(sum(s.tokens for s in stats)))
                         for rid, stats in reported.items()]
        applied = ray.get(self.server.apply.remote(contributions, per_replica * len(members)))
        if not applied.applied:
            return None
        t_applied = time.perf_counter()
        self.round_index, self.data_position = applied.round + 1, applied.data_position
        self._weights_ref = self.server.weights.remote()

        eval_loss = self._evaluate()
        ok = [reported[rid] for rid in applied.accepted]
        all_stats = [s for stats in ok for s in stats]
        compute = max(max(s.compute_seconds for s in stats) for stats in ok)
        steps = sum(s.inner_steps for s in all_stats)
        record = {
            "event": "round",
            "round": applied.round,
            "replicas": len(applied.accepted),
            "replica_ids": applied.accepted,
            "dropped": sorted(set(dropped) | {r.id for r in failed} | set(applied.rejected)),
            "rejected": {str(k): v for k, v in applied.rejected.items()},
            "inner_steps": cfg.max_steps,
            "tokens": sum(s.tokens for s in all_stats),
            "train_loss": sum(s.loss_sum for s in all_stats) / max(steps, 1),
            "eval_loss": eval_loss,
            "eval_ppl": math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None,
            "outer_lr": applied.outer_lr,
            "pseudo_grad_norm": applied.pseudo_grad_norm,
            "bytes_up": sum(s.bytes_up for stats in reported.values() for s in stats),
            "bytes_down": self.weight_bytes * len(members),
            "round_seconds": time.perf_counter() - t_start,
            "sync_seconds": max(0.0, (t_applied - t_start) - compute),
            "compute_seconds": compute,
        }
        self._log(record)
        for cb in self.callbacks:
            hook: Optional[Callable] = getattr(cb, "on_round_end", None)
            if hook is not None:
                hook(self, record)
        self._reconcile()
        return record

    def _gather(self, launched: dict, timeout_s: Optional[float]):
        """Wait for every replica's stats until the deadline.

        Returns (reported: id -> [RoundStats], dropped: late ids, failed: dead replicas).
        """
        owner = {ref: rid for rid, (_, _, stats) in launched.items() for ref in stats}
        refs = list(owner)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        ready = set(ready)
        reported, dropped, failed = {}, [], []
        for rid, (rep, _, stats_refs) in launched.items():
            if not all(r in ready for r in stats_refs):
                dropped.append(rid)
                continue
            try:
                reported[rid] = ray.get(stats_refs)
            except RayActorError:
                failed.append(rep)
            except RayTaskError as e:
                if isinstance(unwrap(e), UserInputError):
                    raise
                failed.append(rep)
        return reported, dropped, failed

    def _evaluate(self) -> Optional[float]:
        if self.config.eval_batches == 0 or not self.replicas:
            return None
        results = ray.get(self.replicas[0].evaluate(self._weights_ref))
        total, count = sum(r[0] for r in results), sum(r[1] for r in results)
        return total / count if count else None

    # ---- membership -------------------------------------------------------------------
    def _reconcile(self) -> None:
        """Move the replica count towards the target, at a round boundary."""
        target = self.target_replicas
        while len(self.replicas) > target:
            self._remove(self.replicas[-1], "scaled down")
        if len(self.replicas) < target:
            self._start_replicas(target - len(self.replicas))

    def _remove(self, rep: Replica, reason: str) -> None:
        rep.stop()
        if rep in self.replicas:
            self.replicas.remove(rep)
        self._log({"event": "membership", "action": "leave", "replica_id": rep.id, "reason": reason,
                   "round": self.round_index, "replicas": len(self.replicas)})

    # ---- output and teardown ----------------------------------------------------------
    def save_final(self) -> str:
        """Write the global weights as a Hugging Face model to ``output_dir/final``."""
        path = os.path.abspath(os.path.join(self.config.output_dir, "final"))
        ray.get(self.replicas[0].save_final(self._weights_ref, path))
        return path

    def _log(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(record)

    def shutdown(self) -> None:
        """Stop replicas and server; stop Ray if this trainer started it."""
        for rep in list(self.replicas):
            rep.stop()
        self.replicas = []
        if self.server is not None:
            try:
                ray.kill(self.server, no_restart=True)
            except Exception:
                pass
            self.server = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _prepare_output_dir(cfg: TrainerConfig) -> None:
    """Create output_dir; refuse to mix a new run into one that already holds a run."""
    path = cfg.output_dir
    if os.path.exists(os.path.join(path, "metrics.jsonl")) and not cfg.overwrite_output_dir:
        raise ConfigError(f"output_dir: '{path}' already holds a run (metrics.jsonl); choose a new "
                          "output_dir or set overwrite_output_dir: true")
    if cfg.overwrite_output_dir and os.path.exists(os.path.join(path, "metrics.jsonl")):
        os.remove(os.path.join(path, "metrics.jsonl"))
    os.makedirs(path, exist_ok=True)
