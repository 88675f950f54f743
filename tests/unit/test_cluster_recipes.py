"""The recipes in cluster/ are valid in their own formats and agree with the jobs they run.

Nothing here starts Ray or touches the network. The cluster launcher configs are checked
with Ray's own schema and config preparation, the shell scripts' `ray start` / `ray job
submit` lines and the RayJob's entrypoint with Ray's and diloco-ray's own CLI parsers, and
every job a recipe names is loaded with TrainerConfig, so a recipe cannot drift from the
config it was sized for (GPUs per node = ranks per replica, regions that exist, ...).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from diloco_ray.cli import build_parser
from diloco_ray.config.schema import TrainerConfig, parse_set
from diloco_ray.runtime.replica import resources_for_replica

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "cluster")
LAUNCHERS = ["aws.yaml", "gcp.yaml"]
SCRIPTS = ["local_multinode.sh", "local_regions.sh", "local_ray_lib.sh", "local_regions_rehearsal.sh"]
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives every head node this resource
REMOTE_OUTPUT = ("s3://", "gs://")
SUBMIT = re.compile(r"^(\w+=\S+\s+)*ray job submit ")  # a command line, not prose about one


def _read(name: str) -> str:
    with open(os.path.join(CLUSTER, name)) as f:
        return f.read()


def _logical_lines(text: str, comments: bool = False) -> list[str]:
    """Shell lines with backslash continuations joined; with ``comments``, the text of
    ``#`` comment lines instead (where the launcher configs show their commands)."""
    lines = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") != comments:
            continue
        if comments:
            stripped = stripped.lstrip("#").strip()
        lines.append(stripped)
    joined, out = "", []
    for line in lines:
        if line.endswith("\\"):
            joined += line[:-1] + " "
        else:
            out.append(joined + line)
            joined = ""
    return out


def _train_config(argv: list[str]) -> TrainerConfig:
    """The TrainerConfig a `diloco-ray train ...` / `python -m diloco_ray train ...`
    command line runs: parsed by the real CLI, the config file read from this repository
    (the working_dir every recipe ships), its --set overrides applied."""
    if argv[:2] == ["diloco-ray", "train"]:
        rest = argv[1:]
    elif argv[:4] == ["python", "-m", "diloco_ray", "train"]:
        rest = argv[3:]
    else:
        raise AssertionError(f"not a diloco-ray train command: {argv}")
    args = build_parser().parse_args(rest)
    path = os.path.join(ROOT, args.config)
    assert os.path.isfile(path), f"{args.config} is not a file of this repository"
    return TrainerConfig.from_yaml(path, overrides=parse_set(args.overrides))


def _check_remote_output_dir(cfg: TrainerConfig) -> None:
    # Nodes share no disk (the driver writes metrics.jsonl, a worker's rank final/).
    assert cfg.output_dir.startswith(REMOTE_OUTPUT), cfg.output_dir
    from diloco_ray.persist.storage import check_uri

    check_uri("output_dir", cfg.output_dir)


# ---------------------------------------------------------------------------------------
# Cluster launcher configs (ray up)
# ---------------------------------------------------------------------------------------


def _launcher(name: str) -> dict:
    """The config as `ray up` sees it before it calls the cloud: merged with the
    provider's defaults and validated against ray-schema.json."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(yaml.safe_load(_read(name))))
    validate_config(config)
    return config


def _submit(name: str) -> tuple[dict, TrainerConfig]:
    """The `ray job submit` command a launcher config documents: its options as Ray's
    CLI parses them, and the job config its entrypoint runs."""
    from ray.dashboard.modules.job.cli import submit

    commands = [line for line in _logical_lines(_read(name), comments=True) if SUBMIT.match(line)]
    assert len(commands) == 1, f"{name} should show one `ray job submit` command"
    words = shlex.split(commands[0])
    words = words[words.index("ray") + 3 :]  # after the env assignments and `ray job submit`
    params = submit.make_context("submit", words).params
    return params, _train_config(list(params["entrypoint"]))


def _worker_type(config: dict) -> dict:
    workers = [t for name, t in config["available_node_types"].items() if name != config["head_node_type"]]
    assert len(workers) == 1, "one GPU worker node type, for the replicas"
    return workers[0]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_config_passes_rays_validation(name):
    config = _launcher(name)
    assert config["provider"]["type"] in ("aws", "gcp")


def _check_replicas_fill_worker_nodes(config: dict, cfg: TrainerConfig) -> None:
    worker = _worker_type(config)
    head = config["available_node_types"][config["head_node_type"]]
    # GPUs per node = a replica's ranks on a node (all of them with nodes_per_replica 1): its
    # bundles (1 GPU a rank) fill the node, so no two replicas share one and no GPU idles.
    per_node = cfg.ranks_per_replica // cfg.nodes_per_replica
    assert worker["resources"]["GPU"] == per_node
    assert worker["resources"]["CPU"] >= per_node * cfg.cpus_per_rank
    accelerators = worker["node_config"].get("guestAccelerators")
    if accelerators is not None:  # GCP: the VM must really have the GPUs Ray schedules by
        assert sum(a["acceleratorCount"] for a in accelerators) == worker["resources"]["GPU"]
    # The head has no GPU, so no replica lands there.
    assert head["resources"].get("GPU", 0) == 0
    # Every replica's nodes come up with the cluster; max_replicas can be reached by scaling.
    assert worker["min_workers"] == cfg.num_replicas * cfg.nodes_per_replica
    assert worker["max_workers"] >= cfg.replica_bounds[1] * cfg.nodes_per_replica
    assert config["max_workers"] >= worker["max_workers"]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_runs_one_replica_per_worker_node(name):
    config, (params, cfg) = _launcher(name), _submit(name)
    _check_replicas_fill_worker_nodes(config, cfg)
    assert cfg.nodes_per_replica == 1
    assert params["working_dir"] == "."
    _check_remote_output_dir(cfg)


def _two_node_sets(name: str) -> dict:
    """The ``--set`` values cluster/README.md gives launcher ``name`` for a replica over two
    nodes (its bullet under "A replica per node, or over two")."""
    section = _read("README.md").split("## A replica per node, or over two", 1)[1].split("\n## ", 1)[0]
    bullet = next(b for b in section.split("\n- ") if f"(`{name}`" in b)
    return parse_set(re.findall(r"--set ([^\s`]+)", bullet))


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_holds_the_documented_replica_over_two_nodes(name):
    config, (params, _) = _launcher(name), _submit(name)
    argv = list(params["entrypoint"])
    two_nodes = _two_node_sets(name)
    assert two_nodes["nodes_per_replica"] == 2
    cfg = _train_config(argv + [w for k, v in two_nodes.items() for w in ("--set", f"{k}={v}")])
    _check_replicas_fill_worker_nodes(config, cfg)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_pins_the_server_to_the_head(name):
    config, (_, cfg) = _launcher(name), _submit(name)
    head = config["available_node_types"][config["head_node_type"]]["resources"]
    worker = _worker_type(config)["resources"]
    assert isinstance(cfg.server_resources, dict) and cfg.server_resources
    for key, amount in cfg.server_resources.items():
        assert key == HEAD_RESOURCE or key in head, f"no head resource {key}"
        assert key not in worker, f"workers also offer {key}: the server could land there"
        assert amount <= head.get(key, 1)
    assert cfg.server_cpus <= head["CPU"]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_uses_token_auth_everywhere(name):
    config = _launcher(name)
    head, workers = " ".join(config["head_start_ray_commands"]), " ".join(config["worker_start_ray_commands"])
    for commands, start in ((head, "ray start --head"), (workers, "ray start --address")):
        assert start in commands and "RAY_AUTH_MODE=token" in commands
        assert not re.search(r"RAY_AUTH_MODE=(?!token)", commands)
    # Every node gets the same token as the client that submits jobs.
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    params, _ = _submit(name)
    command = next(line for line in _logical_lines(_read(name), comments=True) if SUBMIT.match(line))
    assert "RAY_AUTH_MODE=token" in command.split("ray job submit")[0]
    if params["runtime_env_json"] is not None:
        assert isinstance(json.loads(params["runtime_env_json"]), dict)


AUTOSCALER_IDENTITIES = ("ray-autoscaler-v1", "ray-autoscaler-sa-v1")


def test_aws_workers_reach_the_runs_bucket_prefix_and_nothing_else():
    """The job's code runs on the workers: their profile is not the head's (which starts
    machines and reads every bucket) but one whose policy names the output_dir's bucket
    and prefix only, with S3 object actions only."""
    worker = _worker_type(_launcher("aws.yaml"))
    assert worker["node_config"]["IamInstanceProfile"]["Name"] == "diloco-ray-worker"
    _, cfg = _submit("aws.yaml")
    bucket, prefix = cfg.output_dir.removeprefix("s3://").split("/", 1)
    top = prefix.split("/", 1)[0]
    policy = json.loads(_read("aws-worker-bucket-policy.json"))
    resources, actions = set(), set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        resources.add(statement["Resource"])
        actions |= set(statement["Action"])
        if statement["Resource"] == f"arn:aws:s3:::{bucket}":  # listing: only under the prefix
            assert statement["Condition"]["StringLike"]["s3:prefix"] == [top, f"{top}/*"]
    assert resources == {f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/{top}/*"}
    assert all(a.startswith("s3:") and "*" not in a for a in actions), actions
    assert "aws-worker-bucket-policy.json" in _read("README.md")


def test_gcp_workers_get_a_storage_only_account_of_their_own():
    worker = _worker_type(_launcher("gcp.yaml"))
    (account,) = worker["node_config"]["serviceAccounts"]
    assert account["email"].split("@")[0] not in AUTOSCALER_IDENTITIES
    assert account["scopes"] == ["https://www.googleapis.com/auth/devstorage.read_write"]
    _, cfg = _submit("gcp.yaml")
    bucket = cfg.output_dir.removeprefix("gs://").split("/", 1)[0]
    readme = _read("README.md")
    assert f"add-iam-policy-binding gs://{bucket}" in readme and "roles/storage.objectUser" in readme


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_installs_torch_then_this_project(name):
    config = _launcher(name)
    repo = [remote for remote, local in config["file_mounts"].items() if local == "."]
    assert len(repo) == 1, "the repository is synced to the nodes"
    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # (no tomllib before Python 3.11)
        torch_spec = Requirement(re.search(r'^\s*"(torch\b[^"]*)"', f.read(), re.M).group(1)).specifier
    for key in ("head_setup_commands", "worker_setup_commands"):
        commands = config[key]  # after prepare_config: setup_commands + the node kind's own
        torch = [i for i, c in enumerate(commands) if re.search(r"pip install torch==", c)]
        project = [i for i, c in enumerate(commands) if c.strip() == f"pip install -e {repo[0]}"]
        assert torch and project and torch[0] < project[0], f"{key}: torch must be installed before the project"
        pinned = re.search(r"torch==(\S+)", commands[torch[0]]).group(1)
        assert torch_spec.contains(pinned), f"torch=={pinned} does not satisfy pyproject's torch{torch_spec}"


# ---------------------------------------------------------------------------------------
# KubeRay RayJob
# ---------------------------------------------------------------------------------------

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_ENV = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string"},
            "value": {"type": "string"},
            "valueFrom": {
                "type": "object",
                "additionalProperties": False,
                "minProperties": 1,
                "maxProperties": 1,
                "properties": {
                    "secretKeyRef": {
                        "type": "object",
                        "required": ["name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "key": {"type": "string"},
                            "optional": {"type": "boolean"},
                        },
                    },
                    "configMapKeyRef": {"type": "object"},
                    "fieldRef": {"type": "object"},
                    "resourceFieldRef": {"type": "object"},
                },
            },
        },
        "not": {"required": ["value", "valueFrom"]},
    },
}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer"]}}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["containers"],
            "properties": {
                "containers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "image"],
                        "properties": {
                            "name": {"type": "string"},
                            "image": {"type": "string"},
                            "env": _ENV,
                            "resources": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"limits": _QUANTITIES, "requests": _QUANTITIES},
                            },
                        },
                    },
                }
            },
        }
    },
}
_COUNT = {"type": "integer", "minimum": 0}
# The fields of ray.io/v1 RayJob and the RayClusterSpec inside it (KubeRay v1.5-v1.6),
# closed, so a misspelt field fails here instead of being dropped by the API server.
RAYJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}},
        },
        "spec": {
            "type": "object",
            "required": ["entrypoint", "rayClusterSpec"],
            "additionalProperties": False,
            "properties": {
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "backoffLimit": _COUNT,
                "rayClusterSpec": {
                    "type": "object",
                    "required": ["headGroupSpec"],
                    "additionalProperties": False,
                    "properties": {
                        "authOptions": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "mode": {"enum": ["disabled", "token"]},
                                "secretName": {"type": "string"},
                                "enableK8sTokenAuth": {"type": "boolean"},
                            },
                        },
                        "headGroupSpec": {
                            "type": "object",
                            "required": ["rayStartParams", "template"],
                            "additionalProperties": False,
                            "properties": {
                                "rayStartParams": _STR_MAP,
                                "template": _POD_TEMPLATE,
                                "headService": {"type": "object"},
                                "enableIngress": {"type": "boolean"},
                                "serviceType": {"type": "string"},
                            },
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["groupName", "rayStartParams", "template"],
                                "additionalProperties": False,
                                "properties": {
                                    "groupName": {"type": "string"},
                                    "replicas": _COUNT,
                                    "minReplicas": _COUNT,
                                    "maxReplicas": _COUNT,
                                    "idleTimeoutSeconds": _COUNT,
                                    "numOfHosts": _COUNT,
                                    "rayStartParams": _STR_MAP,
                                    "template": _POD_TEMPLATE,
                                    "suspend": {"type": "boolean"},
                                    "scaleStrategy": {"type": "object"},
                                },
                            },
                        },
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "autoscalerOptions": {"type": "object"},
                        "headServiceAnnotations": _STR_MAP,
                        "gcsFaultToleranceOptions": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "managedBy": {"type": "string"},
                        "upgradeStrategy": {"type": "object"},
                    },
                },
                "submitterPodTemplate": {"type": "object"},
                "metadata": _STR_MAP,
                "clusterSelector": _STR_MAP,
                "submitterConfig": {"type": "object"},
                "managedBy": {"type": "string"},
                "deletionStrategy": {"type": "object"},
                "entrypoint": {"type": "string"},
                "runtimeEnvYAML": {"type": "string"},
                "jobId": {"type": "string"},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                "entrypointResources": {"type": "string"},
                "entrypointNumCpus": {"type": "number"},
                "entrypointNumGpus": {"type": "number"},
                "ttlSecondsAfterFinished": _COUNT,
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "suspend": {"type": "boolean"},
            },
        },
    },
}


def _rayjob() -> dict:
    docs = [d for d in yaml.safe_load_all(_read("kuberay-rayjob.yaml")) if d]
    assert len(docs) == 1
    return docs[0]


def _containers(job: dict) -> dict[str, list[dict]]:
    """Group name ("head" or a worker group's) -> its pod's containers."""
    spec = job["spec"]["rayClusterSpec"]
    out = {"head": spec["headGroupSpec"]["template"]["spec"]["containers"]}
    for group in spec.get("workerGroupSpecs", []):
        out[group["groupName"]] = group["template"]["spec"]["containers"]
    return out


def test_rayjob_has_the_kuberay_v1_shape():
    job = _rayjob()
    jsonschema.validate(job, RAYJOB_SCHEMA)
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    # Token authentication in KubeRay needs Ray 2.52 or newer on the cluster.
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    assert tuple(int(p) for p in cluster["rayVersion"].split(".")[:2]) >= (2, 52)


def test_rayjob_entrypoint_runs_a_config_of_this_repository():
    job = _rayjob()
    cfg = _train_config(shlex.split(job["spec"]["entrypoint"]))  # the submitter runs it with bash
    _check_remote_output_dir(cfg)
    assert set(cfg.server_resources) == {HEAD_RESOURCE}, "the server stays off the GPU pods"


def test_rayjob_runtime_env_is_one_ray_accepts():
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load(_rayjob()["spec"]["runtimeEnvYAML"])
    assert isinstance(env, dict)
    RuntimeEnv(**env)  # Ray's own checks: field types, env_vars all strings, ...
    # The submitter pod has no checkout to upload: the code must come from a URI.
    assert re.match(r"(https|s3|gs)://.+\.zip$", env["working_dir"]), env["working_dir"]
    packages = env["pip"]["packages"] if isinstance(env["pip"], dict) else env["pip"]
    names = [Requirement(p).name for p in packages]
    assert names.index("torch") < names.index("diloco-ray")
    assert str(Requirement(packages[names.index("torch")]).specifier).startswith("==")
    # Secrets come from the pods' env, not from the runtime_env stored with the job.
    assert not {"WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(env.get("env_vars", {}))


def test_rayjob_gives_each_replica_one_pod_of_its_gpus():
    job = _rayjob()
    cfg = _train_config(shlex.split(job["spec"]["entrypoint"]))
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert len(groups) == 1
    group, containers = groups[0], _containers(job)
    limits = containers[group["groupName"]][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == cfg.ranks_per_replica
    assert float(limits["cpu"]) >= cfg.ranks_per_replica * cfg.cpus_per_rank
    assert group["minReplicas"] <= cfg.num_replicas <= group["replicas"] <= group["maxReplicas"]
    assert group["maxReplicas"] >= cfg.replica_bounds[1]
    assert "nvidia.com/gpu" not in containers["head"][0].get("resources", {}).get("limits", {})


def test_rayjob_takes_secrets_from_a_kubernetes_secret():
    job = _rayjob()
    cfg = _train_config(shlex.split(job["spec"]["entrypoint"]))
    for group, containers in _containers(job).items():
        env = {e["name"]: e for e in containers[0].get("env", [])}
        for name in ("WANDB_API_KEY", "HF_TOKEN"):
            assert name in env, f"{group}: no {name}"
            assert "value" not in env[name], f"{group}: {name} written into the manifest"
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref["name"] and ref["key"]
        # The job logs to W&B: the key must be there, not optional.
        if "wandb" in (cfg.log_with or []):
            assert not env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"].get("optional", False)


# ---------------------------------------------------------------------------------------
# Cross-region placement: cluster/cross_region.yaml on cluster/local_regions.sh's nodes
# ---------------------------------------------------------------------------------------


def _lib_opts() -> str:
    """The options the local scripts pass to every `ray start` (RAY_LOCAL_OPTS)."""
    match = re.search(r"RAY_LOCAL_OPTS=\((.*?)\)", _read("local_ray_lib.sh"), re.S)
    return match.group(1)


def _ray_starts(script: str) -> list[dict]:
    """The nodes a local script starts, as Ray's `ray start` parses its command lines
    (shell variables replaced by stand-in values)."""
    from ray.scripts.scripts import start

    nodes, dirs = [], []
    for line in _logical_lines(_read(script)):
        if not line.startswith("ray start"):
            continue
        assert '"${RAY_LOCAL_OPTS[@]}"' in line, "every node needs the cluster's options (local_ray_lib.sh)"
        # Under the cluster's temp dir (see ray_local_stop), and a dir of its own: nodes sharing
        # one remove each other's copies of a running job's working_dir.
        dirs.append(re.search(r'--temp-dir "\$RAY_LOCAL_TMP/(\w+)"', line).group(1))
        assert dirs.count(dirs[-1]) == 1, f"{script}: two nodes share the temp dir {dirs[-1]}"
        line = line.replace('"${RAY_LOCAL_OPTS[@]}"', _lib_opts())
        line = re.sub(r"\$\(\([^)]*\)\)", "1", line)  # $((agent + 1))
        line = re.sub(r"\$\{?\w+(:-[^}]*)?\}?", "1", line)  # $port, ${X:-default}
        words = [w for w in shlex.split(line) if not w.startswith(">")][2:]
        params = start.make_context("start", words).params
        nodes.append(
            {"head": params["head"], "CPU": float(params["num_cpus"]), **json.loads(params["resources"] or "{}")}
        )
    return nodes


def _default_config(script: str) -> str:
    return re.search(r"^config=(\S+)$", _read(script), re.M).group(1)


def _demands(cfg: TrainerConfig) -> list[list[dict]]:
    """What the job places: the server actor (one bundle) and, per replica, its
    STRICT_PACK group of ranks_per_replica bundles (all on one node)."""
    server = [{"CPU": cfg.server_cpus, **cfg.server_resources}]
    replicas = [
        [{"CPU": cfg.cpus_per_rank, **resources_for_replica(cfg.replica_resources, i)}] * cfg.ranks_per_replica
        for i in range(cfg.num_replicas)
    ]
    return [server] + replicas


def _fits_every_way(nodes: list[dict], demands: list[list[dict]]) -> bool:
    """True when every demand can be placed whatever order Ray places them in and
    whichever feasible node it picks for each: no choice strands a later one."""

    def place(free, left):
        if not left:
            return True
        for i, group in enumerate(left):
            need = {}
            for bundle in group:
                for k, v in bundle.items():
                    need[k] = need.get(k, 0) + v
            options = [n for n, avail in enumerate(free) if all(avail.get(k, 0) >= v - 1e-9 for k, v in need.items())]
            if not options:
                return False
            for n in options:
                after = [dict(a) for a in free]
                for k, v in need.items():
                    after[n][k] -= v
                if not place(after, left[:i] + left[i + 1 :]):
                    return False
        return True

    free = [{k: v for k, v in node.items() if k != "head"} for node in nodes]
    return place(free, demands)


def test_cross_region_config_pins_replicas_and_server_to_regions():
    cfg = TrainerConfig.from_yaml(os.path.join(CLUSTER, "cross_region.yaml"))
    regions = [set(resources_for_replica(cfg.replica_resources, i)) for i in range(cfg.num_replicas)]
    assert all(len(r) == 1 for r in regions), "each replica is pinned to one region"
    assert len(set().union(*regions)) >= 2, "replicas in more than one region"
    assert len(cfg.server_resources) == 1, "the server sits in one region"
    assert cfg.pseudo_grad_compression == "int8" and cfg.error_feedback
    assert cfg.diloco_loops <= 3 and cfg.model_name is None, "a small job: the local rehearsal runs it"


def test_local_regions_script_provides_every_region_the_job_asks_for():
    script = "local_regions.sh"
    cfg = TrainerConfig.from_yaml(os.path.join(ROOT, _default_config(script)))
    nodes = _ray_starts(script)
    assert sum(n["head"] for n in nodes) == 1
    offered = {k for n in nodes for k in n if k not in ("head", "CPU")}
    asked = set(cfg.server_resources).union(
        *(resources_for_replica(cfg.replica_resources, i) for i in range(cfg.replica_bounds[1]))
    )
    assert asked <= offered, f"no node offers {asked - offered}"
    # The server's region is the head's, where `ray job submit` runs the driver.
    head = next(n for n in nodes if n["head"])
    assert set(cfg.server_resources) <= set(head)
    # A replica's bundles fit on one node of its region, and in any placement order the
    # server and all replicas find room.
    for group in _demands(cfg)[1:]:
        need = {k: sum(b[k] for b in group) for k in group[0]}
        assert any(all(n.get(k, 0) >= v for k, v in need.items()) for n in nodes), need
    assert _fits_every_way(nodes, _demands(cfg))


def test_fit_check_catches_a_region_without_room():
    cfg = TrainerConfig.from_yaml(os.path.join(CLUSTER, "cross_region.yaml"))
    nodes = _ray_starts("local_regions.sh")
    eu = [n for n in nodes if "region-eu" in n]
    assert _fits_every_way(nodes, _demands(cfg))
    eu[0]["CPU"] = 1  # room for one EU replica of two
    assert not _fits_every_way(nodes, _demands(cfg))


# ---------------------------------------------------------------------------------------
# The local scripts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_valid_bash(script):
    subprocess.run(["bash", "-n", os.path.join(CLUSTER, script)], check=True)


@pytest.mark.parametrize("script", ["local_multinode.sh", "local_regions.sh"])
def test_local_script_uses_token_auth_and_stops_only_its_cluster(script):
    text = _read(script)
    assert "source cluster/local_ray_lib.sh" in text and "trap ray_local_stop EXIT" in text
    # `ray stop` ends every Ray process of the user, other people's clusters included.
    for name in (script, "local_ray_lib.sh"):
        assert not any(re.match(r"ray stop\b", line) for line in _logical_lines(_read(name)))
    assert re.search(r"^export RAY_AUTH_MODE=\$\{RAY_AUTH_MODE:-token\}$", _read("local_ray_lib.sh"), re.M)
    nodes = _ray_starts(script)
    assert len(nodes) >= 2 and sum(n["head"] for n in nodes) == 1
    submit = [line for line in _logical_lines(text) if SUBMIT.match(line)]
    assert len(submit) == 1 and "--working-dir ." in submit[0]
    words = shlex.split(submit[0])
    assert words[words.index("--") + 1 :][:5] == ["python", "-m", "diloco_ray", "train", "$config"]
    assert os.path.isfile(os.path.join(ROOT, _default_config(script)))


@pytest.mark.parametrize("script", ["local_multinode.sh", "local_regions.sh"])
def test_local_script_ports_avoid_rays_defaults(script):
    text = _read(script)
    ports = {name: int(value) for name, value in re.findall(r"\$\{(RAY_\w+PORT):-(\d+)\}", text)}
    assert {"RAY_HEAD_PORT", "RAY_DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT"} <= set(ports)
    assert not {6379, 8265, 10001, 52365} & set(ports.values())
    # Ray refuses a client port inside its worker port range (10002-19999 by default).
    assert not 10002 <= ports["RAY_CLIENT_PORT"] <= 19999


def test_local_scripts_do_not_share_ports():
    ports = [
        dict(re.findall(r"\$\{(RAY_\w+PORT):-(\d+)\}", _read(s))) for s in ("local_multinode.sh", "local_regions.sh")
    ]
    agents = [int(p["RAY_AGENT_PORT"]) for p in ports]
    used = [set(p.values()) - {p["RAY_AGENT_PORT"]} for p in ports]
    assert not used[0] & used[1]
    assert abs(agents[0] - agents[1]) >= 3  # one agent port per node: agent, agent+1, agent+2


def test_the_regions_rehearsal_gives_each_region_a_token_of_its_own_and_sets_only_config_fields():
    from diloco_ray.config.fields import FIELD_NAMES

    text = _read("local_regions_rehearsal.sh")
    keys = re.findall(r'--set "?([a-z_]+)=', text)
    assert {"regions", "channel_tokens_file", "channel_tls_cert", "channel_tls_key"} <= set(keys)
    assert set(keys) <= set(FIELD_NAMES)
    assert "umask 077" in text and "--token-file" in text and "DILOCO_CHANNEL_TOKEN" not in text
