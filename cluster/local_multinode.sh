#!/usr/bin/env bash
# A two-node Ray cluster on this one machine (a head and one worker node, each its own
# raylet), and the embedded default submitted to it with `ray job submit`, the way a
# job reaches a real cluster. Usage: cluster/local_multinode.sh [CONFIG] [--set K=V ...]
# Stops the cluster on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/tiny.yaml}; shift || true
port=${RAY_HEAD_PORT:-6390}
dash=${RAY_DASHBOARD_PORT:-8275}
out=${OUTPUT_DIR:-$(mktemp -d)/run}
# Ray 2.5x+ enables token auth on new clusters; every process here must use the same mode.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT

ray start --head --port "$port" --num-cpus 2 --dashboard-host 127.0.0.1 --dashboard-port "$dash" \
  --include-dashboard true --disable-usage-stats >/dev/null
ray start --address "127.0.0.1:$port" --num-cpus 2 --disable-usage-stats >/dev/null
echo "cluster up: $(python -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(len(ray.nodes()), "nodes,", ray.cluster_resources().get("CPU"), "CPUs")')"

# The job runs against the cluster through its dashboard address, as on a real one.
RAY_ADDRESS="http://127.0.0.1:$dash" ray job submit --working-dir . -- \
  python -m diloco_ray train "$config" --set output_dir="$out" "$@"
echo "outputs in $out"
