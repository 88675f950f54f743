#!/usr/bin/env bash
# A rehearsal of a cross-region job on one machine: a three-node Ray cluster (three
# raylets) whose nodes name their region with a custom resource -- the head and one
# worker in "region-us", one worker in "region-eu" -- and a job submitted to it with
# `ray job submit`, the way it reaches a real cluster. The default job is
# cluster/cross_region.yaml, which pins replicas and the parameter server to regions.
#
#   cluster/local_regions.sh [CONFIG] [--set KEY=VALUE ...]
#
# Env: OUTPUT_DIR (the run's folder; default a new temp dir), RAY_HEAD_PORT,
# RAY_DASHBOARD_PORT, RAY_CLIENT_PORT, RAY_AGENT_PORT (ports chosen away from Ray's
# defaults so another local Ray keeps working), RAY_AUTH_MODE (default token).
# Stops this cluster, and only it, on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
config=cluster/cross_region.yaml
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config=$1; shift; fi
port=${RAY_HEAD_PORT:-6392}
dash=${RAY_DASHBOARD_PORT:-8277}
client=${RAY_CLIENT_PORT:-23012}  # outside the worker ports (10002-19999)
agent=${RAY_AGENT_PORT:-52412}  # each node's dashboard agent needs its own HTTP port: agent, agent+1, ...
out=${OUTPUT_DIR:-$(mktemp -d)/run}
source cluster/local_ray_lib.sh
trap ray_local_stop EXIT

# Region resources are labels (1 per node; the job asks for slivers of them), so how many
# ranks a node takes is set by its CPUs: the head has one (the server needs 0.5, the
# driver none), each worker two, i.e. two one-rank replicas. Logical CPUs, not cores: on
# a 2-core machine the processes share the cores, just slower.
ray start --head --port "$port" --ray-client-server-port "$client" \
  --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$dash" \
  --dashboard-agent-listen-port "$agent" \
  --num-cpus 1 --resources '{"region-us": 1}' "${RAY_LOCAL_OPTS[@]}" --temp-dir "$RAY_LOCAL_TMP/head" >/dev/null
ray start --address "127.0.0.1:$port" --dashboard-agent-listen-port $((agent + 1)) \
  --num-cpus 2 --resources '{"region-us": 1}' "${RAY_LOCAL_OPTS[@]}" --temp-dir "$RAY_LOCAL_TMP/node2" >/dev/null
ray start --address "127.0.0.1:$port" --dashboard-agent-listen-port $((agent + 2)) \
  --num-cpus 2 --resources '{"region-eu": 1}' "${RAY_LOCAL_OPTS[@]}" --temp-dir "$RAY_LOCAL_TMP/node3" >/dev/null

python - "127.0.0.1:$port" <<'EOF'
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
for n in sorted(ray.nodes(), key=lambda n: not n["Resources"].get("node:__internal_head__")):
    regions = sorted(k for k in n["Resources"] if k.startswith("region-"))
    print(f"node {n['NodeID'][:8]}: {n['Resources'].get('CPU', 0):g} CPUs, {', '.join(regions) or 'no region'}"
          f"{' (head)' if n['Resources'].get('node:__internal_head__') else ''}")
EOF

# The job reaches the cluster through its dashboard (job server) address, as on a real one;
# --working-dir ships this repository (and the config) to every node.
RAY_ADDRESS="http://127.0.0.1:$dash" ray job submit --working-dir . -- \
  python -m diloco_ray train "$config" --set output_dir="$out" "$@"

# Where each replica's ranks and the server ran, from Ray's record of the job's actors.
python - "127.0.0.1:$port" <<'EOF'
import sys, ray
from ray.util.state import list_actors, list_placement_groups
ray.init(address=sys.argv[1], logging_level="ERROR")
region = {n["NodeID"]: ",".join(sorted(k for k in n["Resources"] if k.startswith("region-"))) for n in ray.nodes()}
groups = {g.placement_group_id: g.name for g in list_placement_groups(limit=10000)}
for a in list_actors(detail=True, limit=10000):
    if a.class_name == "ParameterServer":
        print(f"parameter server: {region.get(a.node_id, '?')}")
    elif a.class_name == "RankWorker":
        print(f"{groups.get(a.placement_group_id, 'replica ?')}: {region.get(a.node_id, '?')}")
EOF
echo "outputs in $out"
