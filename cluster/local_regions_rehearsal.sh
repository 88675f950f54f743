#!/usr/bin/env bash
# Regions as Ray clusters of their own, on one machine and without root: the credentials
# set up the way a real deployment sets them up -- a CA and the home's certificate made
# with openssl (as docs/clusters.md shows), a token per region in the home's owner-only
# tokens file and each region's own token in a file of its own -- then the home
# (`diloco-ray train`, a Ray of its own) and two regions (`diloco-ray region`, a Ray of
# its own each) on localhost. Every region here runs one replica; the home one.
#
#   cluster/local_regions_rehearsal.sh [--set KEY=VALUE ...]   # extra fields for the home's job
#
# Env: OUTPUT_DIR (default a new temp dir: the credentials in creds/, the home's run in
# home/, each region's folder and log), CHANNEL_PORT (default 9443), REGIONS (default
# "eu us"). The home's console counts a round's members: its own replicas and each region
# as one ("replicas 3/3"). Stops the regions' agents on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUTPUT_DIR:-$(mktemp -d)}
port=${CHANNEL_PORT:-9443}  # outside Ray's worker ports (10002-19999)
regions=${REGIONS:-eu us}
creds=$out/creds
mkdir -p "$creds"
chmod 700 "$creds"

# 1. A throwaway CA, and the home's certificate for the name the regions dial.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=diloco-rehearsal-ca \
  -keyout "$creds/ca.key" -out "$creds/ca.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout "$creds/home.key" -out "$creds/home.csr" 2>/dev/null
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' >"$creds/san.ext"
openssl x509 -req -in "$creds/home.csr" -CA "$creds/ca.pem" -CAkey "$creds/ca.key" -CAcreateserial \
  -days 2 -extfile "$creds/san.ext" -out "$creds/home.pem" 2>/dev/null

# 2. A token per region: the home lists them all, each region holds only its own.
umask 077
: >"$creds/tokens"
members=""
for r in $regions; do
  token=$(openssl rand -hex 32)
  printf '%s %s\n' "$r" "$token" >>"$creds/tokens"
  printf '%s\n' "$token" >"$creds/$r.token"
  members="$members{name: $r, replicas: 1}, "
done
umask 022

# 3. The regions first (an operator's agents wait for the home), each with a Ray of its own.
pids=()
stop_regions() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_regions EXIT
for r in $regions; do
  RAY_ADDRESS=local python -m diloco_ray region --home "127.0.0.1:$port" --name "$r" \
    --ca-cert "$creds/ca.pem" --server-name localhost --token-file "$creds/$r.token" \
    --output-dir "$out/$r" >"$out/$r.log" 2>&1 &
  pids+=($!)
done

# 4. The home: the embedded default, its own replica and the regions.
RAY_ADDRESS=local python -m diloco_ray train configs/tiny.yaml \
  --set "output_dir=$out/home" --set num_replicas=1 --set diloco_loops=4 \
  --set "regions=[${members%, }]" --set channel_host=127.0.0.1 --set "channel_port=$port" \
  --set "channel_tls_cert=$creds/home.pem" --set "channel_tls_key=$creds/home.key" \
  --set "channel_tokens_file=$creds/tokens" "$@"
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
pids=()
for r in $regions; do tail -n 1 "$out/$r.log"; done
echo "regions rehearsal: the home's run in $out/home, the regions' logs in $out/*.log"
exit $status
