#!/usr/bin/env bash
# A two-node Ray cluster on this one machine (a head and one worker node, each its own
# raylet), and the embedded default submitted to it with `ray job submit`, the way a
# job reaches a real cluster. Usage: cluster/local_multinode.sh [CONFIG] [--set K=V ...]
# Env: OUTPUT_DIR, RAY_HEAD_PORT, RAY_DASHBOARD_PORT, RAY_CLIENT_PORT, RAY_AGENT_PORT
# (ports away from Ray's defaults, so another local Ray keeps working), RAY_AUTH_MODE.
# Stops this cluster, and only it, on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/tiny.yaml
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then config=$1; shift; fi
port=${RAY_HEAD_PORT:-6390}
dash=${RAY_DASHBOARD_PORT:-8275}
client=${RAY_CLIENT_PORT:-23011}  # outside the worker ports (10002-19999)
agent=${RAY_AGENT_PORT:-52402}  # each node's dashboard agent needs its own HTTP port: agent, agent+1
out=${OUTPUT_DIR:-$(mktemp -d)/run}
# RAY_AUTH_MODE=token (Ray 2.52+ token auth, same mode in every process), a temp dir of
# this cluster's own, and ray_local_stop, which ends only this cluster's processes.
source cluster/local_ray_lib.sh
trap ray_local_stop EXIT

ray start --head --port "$port" --ray-client-server-port "$client" \
  --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$dash" \
  --dashboard-agent-listen-port "$agent" --num-cpus 2 "${RAY_LOCAL_OPTS[@]}" --temp-dir "$RAY_LOCAL_TMP/head" >/dev/null
ray start --address "127.0.0.1:$port" --dashboard-agent-listen-port $((agent + 1)) \
  --num-cpus 2 "${RAY_LOCAL_OPTS[@]}" --temp-dir "$RAY_LOCAL_TMP/node2" >/dev/null
echo "cluster up: $(python -c 'import sys, ray; ray.init(address=sys.argv[1], logging_level="ERROR"); print(len(ray.nodes()), "nodes,", ray.cluster_resources().get("CPU"), "CPUs")' "127.0.0.1:$port")"

# The job runs against the cluster through its dashboard address, as on a real one.
RAY_ADDRESS="http://127.0.0.1:$dash" ray job submit --working-dir . -- \
  python -m diloco_ray train "$config" --set output_dir="$out" "$@"
echo "outputs in $out"
