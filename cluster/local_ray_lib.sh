# Shared by cluster/local_multinode.sh and cluster/local_regions.sh (sourced, not run):
# what every process of a local multi-raylet Ray cluster must agree on, and a stop that
# ends this cluster's processes and no one else's.
#
# Why not `ray stop --force`: it ends every Ray process of the user on this machine,
# other local clusters and test runs included. Instead each cluster gets a temp dir of
# its own (pass "${RAY_LOCAL_OPTS[@]}" to every `ray start`); every process Ray starts
# for it names that dir on its command line, so stopping it means signalling exactly
# those processes and their descendants (rank actors rename themselves `ray::...`, and a
# job's driver is a child of its supervisor actor).

# Ray 2.52+ has token authentication. Every process of a cluster, and every client that
# talks to it (ray start, ray job submit, ray.init), must use the same mode and token;
# the token comes from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then
  ray get-auth-token --generate >/dev/null  # writes ~/.ray/auth_token once; `ray start` will not
fi

# Short on purpose: Ray's unix sockets live under it, and their paths are limited to ~107 bytes.
RAY_LOCAL_TMP=$(mktemp -d /tmp/raylocal.XXXXXX)
# --object-store-memory: a few hundred MB is plenty for small jobs, and several raylets
# with the default (30% of RAM each) would claim more shared memory than the machine has.
RAY_LOCAL_OPTS=(--disable-usage-stats --object-store-memory "${RAY_OBJECT_STORE_BYTES:-300000000}")
# Every node also gets a temp dir of its own under RAY_LOCAL_TMP (pass --temp-dir
# "$RAY_LOCAL_TMP/<node>" to each `ray start`): a node's runtime_env agent keeps and
# removes its own copies of a job's working_dir there, so two nodes sharing one dir remove
# the files of a job still running on the other (the job then fails to import its code).

_ray_local_tree() {  # the given pids and all their descendants
  local p
  for p in "$@"; do
    echo "$p"
    _ray_local_tree $(pgrep -P "$p" || true)
  done
}

ray_local_stop() {
  local roots pids left
  roots=$(pgrep -f -- "$RAY_LOCAL_TMP" || true)
  if [ -n "$roots" ]; then
    pids=$(_ray_local_tree $roots | sort -u)
    kill $pids 2>/dev/null || true
    for _ in $(seq 20); do  # raylets stop their workers on SIGTERM: up to 10 s to exit
      left=$(ps -o pid= -p "$(echo $pids | tr ' ' ,)" || true)
      if [ -z "$left" ]; then break; fi
      sleep 0.5
    done
    if [ -n "$left" ]; then kill -9 $left 2>/dev/null || true; fi
  fi
  rm -rf "$RAY_LOCAL_TMP"
}
