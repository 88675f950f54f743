"""Shared test set-up: offline Hugging Face, a tiny job config, a local Ray kept from module to module."""

import os
import random
import socket

# Before anything imports huggingface_hub: tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.pop("RAY_ADDRESS", None)
# A run's ranks and servers are kept for the next run in this process (runtime.warm_actors):
# a new actor imports torch and a rank transformers' model code, most of a tiny run's CPU.
os.environ.setdefault("DILOCO_RAY_KEEP_ACTORS", "1")

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from diloco_ray.config.schema import TrainerConfig

TINY_MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


# The job of the faulted runs that must end with a fault-free run's weights, and of those
# references (``uninterrupted(**EXACT_JOB)``, shared across modules): five short rounds, a
# checkpoint every other round, one parameter server. Runs that need the server state sharded
# (a server lost of two, a sharded checkpoint in a bucket) add TWO_SERVERS: their weights are
# within 1e-6 of one server's (test_low_bandwidth), and these runs compare to 1e-5. A server
# is a process that imports torch: one fewer saves ~1.3 s a run here.
EXACT_JOB = dict(diloco_loops=5, max_steps=4, checkpoint_steps=8, eval_batches=1)
TWO_SERVERS = dict(num_param_servers=2)


def paced(replica: int, rounds: range, seconds: float, region: str = "") -> list[dict]:
    """``slow`` faults that pace replica ``replica`` (of ``region``, if named) by a fixed
    ``seconds`` a step in each of ``rounds``: a round of a known length that costs no CPU,
    which a test of timing rules needs and no load changes (a multiple of a computed step
    is a second on a busy machine and milliseconds on a quiet one). A ``slow`` fault lasts
    one period, so one per round; a replica that starts late fires the ones it missed at
    once."""
    where = {"region": region} if region else {}
    return [{"kind": "slow", **where, "replica": replica, "round": r, "step": 0, "seconds": seconds} for r in rounds]


def seal(folder, round: int = 0) -> str:
    """Write the manifest of every file in ``folder`` (states saved straight into it), as a
    checkpoint commit would: an actor loads only what a manifest vouches for."""
    from diloco_ray.persist import checkpoint
    from diloco_ray.persist.state_files import sha256_file

    folder = str(folder)
    files = {}
    for where, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(where, name), folder).replace(os.sep, "/")
            if rel != checkpoint.MANIFEST:
                files[rel] = sha256_file(os.path.join(where, name))
    with open(os.path.join(folder, checkpoint.MANIFEST), "w") as f:
        f.write(checkpoint.manifest_text(round, {}, files))
    return folder


# Ports a test hands to a server it starts later. Not the kernel's pick (bind to 0): that comes
# from the ephemeral range, where any process's next outgoing connection may take it before
# the server binds (a region gateway failed so in CI). Below the ephemeral range (from 32768)
# and above Ray's worker ports (10002-19999), only another test's pick can collide.
# Drawn from the OS, not the global generator: a library seeding that (a trainer's set-up,
# say) would give both suite workers the same sequence of picks.
FREE_PORTS, PORT_DRAWS = range(20000, 32000), random.SystemRandom()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, outside the kernel's ephemeral range."""
    for _ in range(100):
        port = PORT_DRAWS.choice(FREE_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS}")


def tiny_config(output_dir, **overrides) -> TrainerConfig:
    """A job small enough to run a few rounds in seconds on one CPU core per rank."""
    fields = dict(
        model_config=TINY_MODEL,
        tokenizer_name="builtin:char",
        dataset_name="builtin:arithmetic",
        dataset_kwargs={"num_samples": 2000, "digits": 2},
        seq_len=32,
        batch_size=4,
        max_steps=4,
        diloco_loops=3,
        lr=3e-3,
        warmup_steps=2,
        num_replicas=2,
        eval_batches=2,
        cpus_per_rank=0.5,
        server_cpus=0.25,
        output_dir=str(output_dir),
        seed=0,
    )
    fields.update(overrides)
    return TrainerConfig(**fields)


def model_parts(cfg: TrainerConfig) -> tuple:
    """``(model section, peft section)`` of ``cfg``: what ``build_model`` and ``meta_model`` take."""
    sections = cfg.sections()
    return sections.model, sections.peft


# env: the environment the running shared Ray (ray_local) handed its workers (None: none
# runs); modules: the test modules that use it (found at collection).
_shared_ray = {"env": None, "modules": set()}


# Set in this process while tests run, by pytest and by torch's compiler: nothing for a restart.
_NOT_FOR_WORKERS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def _worker_env() -> dict:
    """What a Ray started now would hand its workers: this process's environment, less what
    changes here while tests run."""
    return {k: v for k, v in os.environ.items() if k not in _NOT_FOR_WORKERS}


def _stop_shared_ray() -> None:
    import ray

    if _shared_ray["env"] is not None:
        ray.shutdown()
        _shared_ray["env"] = None


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for the test module, with more logical CPUs than cores: always a
    private one (address="local"), even where a `ray start` head runs on this machine.

    One instance serves consecutive modules that ask for it (a start and a stop cost ~5 s
    here). It is started again when the environment its workers would inherit changed (a
    module that sets one up first, as test_cloud_output does its S3 endpoint), and stopped
    before a module that does not ask for it (see _one_ray_at_a_time)."""
    import ray

    if _shared_ray["env"] is not None and (_shared_ray["env"] != _worker_env() or not ray.is_initialized()):
        _stop_shared_ray()
    if _shared_ray["env"] is None:
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        _shared_ray["env"] = _worker_env()
    yield ray


# Modules that hand the shared Ray's workers an environment of their own (it restarts for
# them, and again after them): they run last of the modules that use it.
OWN_RAY_ENVIRONMENT = ("test_cloud_output.py",)


def pytest_collection_modifyitems(session, config, items):
    """Unit tests first; then the integration modules marked ``clusters`` (regions, WAN
    rehearsals: the longest, so that under xdist the last modules to start, which decide
    when the suite ends, are short ones); then those that use the shared Ray, one after
    another, before the ones that start a Ray of their own or none: one start and stop of
    Ray for all of them instead of one per run of such modules. Order is otherwise
    kept. Under xdist (``--dist loadfile``) each worker takes whole modules in this order."""

    _shared_ray["modules"] = {item.path for item in items if "ray_local" in item.fixturenames}

    def place(item) -> int:  # per module, so modules stay whole
        if "integration" not in item.path.parts:
            return 0
        if item.get_closest_marker("clusters") is not None:
            return 1
        if item.path not in _shared_ray["modules"]:
            return 4
        return 3 if item.path.name in OWN_RAY_ENVIRONMENT else 2

    items.sort(key=place)


@pytest.fixture(scope="module", autouse=True)
def _one_ray_at_a_time(request):
    """Stop the shared Ray before a module none of whose tests asks for it: such a module may
    start a Ray of its own, or check that none runs in this process."""
    if request.path not in _shared_ray["modules"]:
        _stop_shared_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _stop_ray_at_the_end():
    yield
    _stop_shared_ray()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(**fields)``: the fault-free run of ``tiny_config(..., **fields)`` that a
    faulted run must end like, made once per session for the same fields and shared by every
    module that compares against it (a run costs ~8 s of set-up). The first caller's module
    holds ray_local."""
    import json

    from diloco_ray import DilocoFSDPTrainer

    done = {}

    def run(**fields):
        key = json.dumps(fields, sort_keys=True)
        if key not in done:
            cfg = tiny_config(tmp_path_factory.mktemp("uninterrupted") / "run", **fields)
            done[key] = DilocoFSDPTrainer(cfg).train()
        return done[key]

    return run


def whole_period(worker, job) -> tuple[list, object]:
    """An in-process RankWorker's sync period as the replica drives it: its stats from
    ``run_period``, then its messages from ``message`` (one buffer per server)."""
    stats = worker.run_period(job)
    sent = worker.message(job.period.attempt)
    return (sent if isinstance(sent, list) else [sent]), stats


def first_round(worker, plan, round_index=0):
    """Run sync period 0 of ``round_index`` on an in-process RankWorker, starting from
    the weights it built; returns (pseudo-gradient name -> fp32 tensor, RoundStats)."""
    from diloco_ray.algo import compression
    from diloco_ray.runtime.messages import PeriodId, SyncPeriod
    from diloco_ray.runtime.rank_state import local_rows

    job = SyncPeriod(
        period=PeriodId(round_index, 0, round_index),
        plan=plan,
        messages=worker.sync.seed(local_rows(worker.params)),
        full=True,
        version=0,
    )
    buffers, stats = whole_period(worker, job)
    grads = {}
    for buf in buffers:
        grads.update({n: t for n, (_, t) in compression.unpack_pieces(buf, worker.sync.names)[0].items()})
    return grads, stats


def final_weights(output_dir):
    """``output_dir/final``'s weights, name -> tensor (one file or sharded with an index)."""
    return folder_weights(os.path.join(output_dir, "final"))


def folder_weights(folder):
    """A Hugging Face folder's safetensors weights, name -> tensor, sharded or not."""
    import glob

    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(path))
    return out


def max_abs_diff(a_dir, b_dir) -> float:
    """The largest difference between two runs' final weights."""
    a, b = final_weights(a_dir), final_weights(b_dir)
    return max((a[n] - b[n]).abs().max().item() for n in b)


def wait_for_a_spare(trainer) -> int:
    """Advance the starting spare until it is ready (up to 180 s) and return its id: set-up
    takes longer than a tiny round, and how many rounds depends on how busy the machine is."""
    import time

    deadline = time.monotonic() + 180
    while not trainer.members.spares and time.monotonic() < deadline:
        trainer.members.admit_ready(0.0)
        time.sleep(0.2)
    return trainer.members.spares[0].id


class KillOnceTheSpareIsReady:
    """A callback: at round 0's end (merge 0 in decoupled mode), advances the starting spare
    until it is ready (set-up takes longer than a tiny round, and how many rounds depends on
    how busy the machine is), then kills the last active replica's ranks. Notes the victim,
    the spare and who was active."""

    def on_round_end(self, trainer, record):
        import ray

        if record["round"] != 0:
            return
        self.spare, self.victim = wait_for_a_spare(trainer), trainer.replicas[-1].id
        self.active = [r.id for r in trainer.replicas]
        for rank in trainer.replicas[-1].ranks:
            ray.kill(rank, no_restart=True)


class CrashAfter:
    """A callback that fails the driver after round ``after`` (its checkpoint is already written)."""

    def __init__(self, after: int):
        self.after = after

    def on_round_end(self, trainer, record):
        if record["round"] == self.after:
            raise RuntimeError("injected driver failure")


def applied_positions(rounds) -> list:
    """Every stream position the applied replicas trained on, over all round records."""
    return [p for r in rounds for plan in r["data_ranges"].values() for s, c in plan for p in range(s, s + c)]


def reset_peak_rss() -> int:
    """Reset this process's peak resident memory (VmHWM) to its current RSS; returns it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_rss()


def peak_rss() -> int:
    """This process's peak resident memory in bytes since the last :func:`reset_peak_rss`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def subprocess_env():
    """A driver process's environment: it joins this module's Ray, as a driver of
    ``ray job submit`` joins its cluster (a Ray of its own would cost seconds to start);
    when its process dies, Ray ends its job's actors."""
    import ray

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address if ray.is_initialized() else "local"
    return env


def resume_cli(cfg):
    """``diloco-ray train OUTPUT_DIR/config.yaml --set resume_from=OUTPUT_DIR``, as a user
    would (without the fault plan that stopped it)."""
    import subprocess
    import sys

    out = cfg.output_dir
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "diloco_ray",
            "train",
            os.path.join(out, "config.yaml"),
            "--set",
            f"resume_from={out}",
            "--set",
            "fault_plan=null",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed
