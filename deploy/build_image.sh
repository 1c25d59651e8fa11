#!/usr/bin/env bash
# Build the CPU image (Dockerfile.cpu) without Docker and without an image registry, then smoke-test it:
#   1. a Debian bookworm base (Python 3.11, venv, headers) made with debootstrap and committed as a
#      local image, localhost/dspark-base:bookworm (no registry needed; skipped when it exists);
#   2. `buildah bud -f Dockerfile.cpu --build-arg BASE=localhost/dspark-base:bookworm` (pip reaches PyPI
#      over the host's network: chroot isolation shares it);
#   3. the image's own CMD run with `buildah run` (host network) on $PORT, /health polled, the image's
#      HEALTHCHECK command run inside it, one chat completion, then the server stopped.
# Run as root from anywhere:  bash deploy/build_image.sh
# Needs: apt-get install buildah debootstrap curl (podman is not used).
# Knobs (environment):
#   IMAGE=localhost/dspark-cpu:latest  BASE_IMAGE=localhost/dspark-base:bookworm  REBUILD_BASE=1
#   MIRROR=<Debian mirror>             (default: the first one apt uses here, else deb.debian.org)
#   SECURITY_MIRROR=<...>              (default: $MIRROR with /debian-security for /debian)
#   EXTRA_CA_DIR=/usr/local/share/ca-certificates  this host's extra CAs (*.crt) go into the base, and pip
#                                      there uses the system store (for a TLS-inspecting proxy; empty: none)
#   TORCH_WHEELS=<dir>                 serve that folder's torch-*+cpu wheel to the build over 127.0.0.1
#                                      (e.g. /opt/wheels) instead of PyPI's CUDA build of torch
#   TORCH_SPEC=torch==2.13.0           (torch==2.13.0+cpu by default with TORCH_WHEELS)
#   WARMUP=1  PORT=8000  SMOKE=1  (SMOKE=0: build only)  WORK=/var/tmp/dspark-image
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-localhost/dspark-cpu:latest}
BASE_IMAGE=${BASE_IMAGE:-localhost/dspark-base:bookworm}
WORK=${WORK:-/var/tmp/dspark-image}
PORT=${PORT:-8000}
SMOKE=${SMOKE:-1}
WARMUP=${WARMUP:-1}
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}      # no overlay/fuse needed
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}  # no user namespaces or CNI needed; host network

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { log "FAILED: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (debootstrap, buildah with the vfs driver)"
for tool in buildah debootstrap curl; do
    command -v "$tool" >/dev/null || die "$tool is missing: apt-get update && apt-get install -y buildah debootstrap curl"
done
mkdir -p "$WORK"
T0=$SECONDS

# --- 1. the base image --------------------------------------------------------------------------
mirror() {
    local m
    m=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null \
        | grep -oE 'https?://[^ ]+' | head -n1 || true)
    echo "${m:-http://deb.debian.org/debian}"
}
if [ "${REBUILD_BASE:-0}" = 1 ] || ! buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    MIRROR=${MIRROR:-$(mirror)}
    ROOTFS=$WORK/rootfs
    rm -rf "$ROOTFS"
    log "debootstrap bookworm from $MIRROR into $ROOTFS"
    # python3-dev: the headers torch's C++ extension loader compiles dspark's kernels against (slim images have them)
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
        bookworm "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK/debootstrap.log"; die "debootstrap (log: $WORK/debootstrap.log)"; }
    cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${SECURITY_MIRROR:-${MIRROR%/debian}/debian-security} bookworm-security main
EOF
    # This site's own CA certificates (a TLS-inspecting egress proxy, a company CA): without them pip
    # inside the build cannot verify pypi.org. pip in bookworm's venv (23.0) reads certifi, not the
    # system store, so the base's /etc/pip.conf points it there. EXTRA_CA_DIR= (empty) skips this.
    ca_dir=${EXTRA_CA_DIR-/usr/local/share/ca-certificates}
    cas=()
    if [ -n "$ca_dir" ]; then shopt -s nullglob; cas=("$ca_dir"/*.crt); shopt -u nullglob; fi
    if [ "${#cas[@]}" -gt 0 ]; then
        mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
        cp "${cas[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
        chroot "$ROOTFS" update-ca-certificates >/dev/null
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ROOTFS/etc/pip.conf"
        log "base trusts this host's extra CA certificates: ${cas[*]##*/}"
    fi
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$ROOTFS" -cf - . | tar -C "$mnt" -xf -
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
        --cmd python3 --label org.opencontainers.image.description="Debian bookworm minbase + python3.11" "$ctr"
    buildah commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
    rm -rf "$ROOTFS"
    log "base image $BASE_IMAGE committed ($((SECONDS - T0)) s)"
else
    log "base image $BASE_IMAGE exists (REBUILD_BASE=1 makes it again)"
fi

# --- 2. the CPU image ---------------------------------------------------------------------------
args=(--build-arg "BASE=$BASE_IMAGE" --build-arg "WARMUP=$WARMUP")
server_pid=
wheel_pid=
ctr=
tree() {  # a process and its descendants, by id
    local c
    echo "$1"
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do tree "$c"; done
}
stop_server() {  # SIGTERM to the server (the innermost process, as `docker stop` to PID 1); true once
    local pids p _ leaves=()  # it and `buildah run` above it are gone
    mapfile -t pids < <(tree "$server_pid")
    for p in "${pids[@]}"; do [ -n "$(cat /proc/"$p"/task/*/children 2>/dev/null)" ] || leaves+=("$p"); done
    kill -TERM "${leaves[@]}" 2>/dev/null || true
    for _ in $(seq 30); do
        alive "${pids[@]}" || return 0
        sleep 1
    done
    return 1
}
alive() {  # whether any of these processes is still there
    local p
    for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done
    return 1
}
cleanup() {
    if [ -n "$server_pid" ]; then stop_server || kill -KILL $(tree "$server_pid") 2>/dev/null || true; fi
    if [ -n "$wheel_pid" ]; then kill "$wheel_pid" 2>/dev/null || true; fi
    if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
if [ -n "${TORCH_WHEELS:-}" ]; then
    ls "$TORCH_WHEELS"/torch-*.whl >/dev/null 2>&1 || die "no torch wheel in $TORCH_WHEELS"
    wport=$((PORT + 1))
    python3 -m http.server --bind 127.0.0.1 --directory "$TORCH_WHEELS" "$wport" >"$WORK/wheels.log" 2>&1 &
    wheel_pid=$!
    sleep 1
    args+=(--build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$wport/" --build-arg "TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}")
    log "torch from $TORCH_WHEELS (served on 127.0.0.1:$wport)"
elif [ -n "${TORCH_SPEC:-}" ]; then
    args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC")
fi
log "buildah bud -f Dockerfile.cpu -t $IMAGE ${args[*]}"
T1=$SECONDS
# --format docker: the OCI format has no HEALTHCHECK (buildah would drop it)
buildah bud --format docker --isolation chroot "${args[@]}" \
    -f "$ROOT/Dockerfile.cpu" -t "$IMAGE" "$ROOT" 2>&1 | tee "$WORK/build.log" \
    || die "buildah bud (log: $WORK/build.log)"
if [ -n "$wheel_pid" ]; then kill "$wheel_pid" 2>/dev/null || true; wheel_pid=; fi
log "built $IMAGE in $((SECONDS - T1)) s; size: $(buildah images --format '{{.Size}}' "$IMAGE")"

[ "$SMOKE" = 1 ] || { log "SMOKE=0: not run"; exit 0; }

# --- 3. smoke test ------------------------------------------------------------------------------
if curl -s -o /dev/null "http://127.0.0.1:$PORT/" 2>/dev/null; then die "port $PORT is taken here: PORT=<free port>"; fi
ctr=$(buildah from "$IMAGE")
mapfile -t cmd < <(buildah inspect --type image --format '{{range .Docker.Config.Cmd}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')
mapfile -t health < <(buildah inspect --type image --format '{{if .Docker.Config.Healthcheck}}{{range .Docker.Config.Healthcheck.Test}}{{println .}}{{end}}{{end}}' "$IMAGE" | sed '/^$/d')
[ "${#cmd[@]}" -gt 0 ] || die "the image has no CMD"
[ "${#health[@]}" -gt 1 ] && [ "${health[0]}" = CMD ] || die "the image has no exec-form HEALTHCHECK"
log "image user: $(buildah inspect --type image --format '{{.Docker.Config.User}}' "$IMAGE"); CMD: ${cmd[*]}; HEALTHCHECK: ${health[*]:1}"
[ "$PORT" = 8000 ] || { cmd+=(--port "$PORT"); health=("${health[@]//:8000/:$PORT}"); }
log "buildah run $ctr -- ${cmd[*]}  (log: $WORK/serve.log)"
setsid buildah run --isolation chroot "$ctr" -- "${cmd[@]}" >"$WORK/serve.log" 2>&1 &
server_pid=$!
T2=$SECONDS
until curl -fsS -m 5 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    kill -0 "$server_pid" 2>/dev/null || { tail -n 30 "$WORK/serve.log"; die "the server exited before /health answered"; }
    [ $((SECONDS - T2)) -lt 600 ] || { tail -n 30 "$WORK/serve.log"; die "/health not ready in 600 s"; }
    sleep 3
done
log "/health ready after $((SECONDS - T2)) s: $(curl -sS -m 5 "http://127.0.0.1:$PORT/health")"
if grep -q "converting .*gguf" "$WORK/serve.log"; then log "note: the server converted the GGUF at start (not from the image's cache)"
else log "the converted model came from the image's cache"; fi
buildah run --isolation chroot "$ctr" -- "${health[@]:1}" || die "the image's HEALTHCHECK command failed"
log "the image's HEALTHCHECK command exits 0"
model=$(curl -fsS -m 10 "http://127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
log "POST /v1/chat/completions (model $model)"
curl -fsS -m 300 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}" \
    | tee "$WORK/chat.json"
echo
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["choices"][0]["message"]["content"].strip(), d' "$WORK/chat.json" \
    || die "empty completion"
log "POST /v1/chat/completions with a JSON schema (structured outputs: xgrammar)"
curl -fsS -m 300 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Give the capital of France as JSON.\"}], \"max_tokens\": 48, \"temperature\": 0, \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"capital\", \"schema\": {\"type\": \"object\", \"properties\": {\"capital\": {\"type\": \"string\", \"maxLength\": 20}}, \"required\": [\"capital\"], \"additionalProperties\": false}}}}" \
    | tee "$WORK/chat_json.json"
echo
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); c=d["choices"][0]; assert c["finish_reason"] == "stop", d; assert isinstance(json.loads(c["message"]["content"])["capital"], str), d' "$WORK/chat_json.json" \
    || die "the structured output is not the schema's JSON"
stop_server || die "the server did not stop within 30 s of SIGTERM"
server_pid=
grep -q "Finished server process" "$WORK/serve.log" || die "the server did not shut down cleanly (log: $WORK/serve.log)"
log "server stopped on SIGTERM: $(grep -c 'Finished server process' "$WORK/serve.log") clean uvicorn shutdown"
log "all steps passed in $((SECONDS - T0)) s"
