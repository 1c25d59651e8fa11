#!/usr/bin/env bash
# Build llama.cpp's command-line tools from the source that the llama-cpp-python sdist vendors.
#
#     scripts/build_llamacpp.sh            # -> ~/.cache/dspark/llama.cpp/build/bin
#     LLAMACPP_DIR=/some/dir scripts/build_llamacpp.sh
#
# Idempotent: it downloads nothing and builds nothing when the tools are already there (built with
# the same cmake arguments; otherwise it configures again and make rebuilds what changed). Installs
# cmake and g++ with apt when they are absent. Prints the directory holding the binaries on its
# last line (the only line on stdout), so callers can do BIN=$(scripts/build_llamacpp.sh).
# The source tree also carries convert_hf_to_gguf.py and gguf-py.
set -euo pipefail

DIR="${LLAMACPP_DIR:-$HOME/.cache/dspark/llama.cpp}"
JOBS="${LLAMACPP_JOBS:-2}"
TARGETS=(llama-quantize llama-bench llama-server llama-speculative llama-batched-bench)
BIN="$DIR/build/bin"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$HERE/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

log() { echo "[build_llamacpp] $*" >&2; }

# -march=native, except on a CPU that reports AMX: there ggml's AMX kernels die on the first
# multi-token batch of our VMs (SIGILL at `tilezero`, or a GPF at `ldtilecfg`: the guest does not
# grant the AMX tile state), so build for the same ISA without AMX (LLAMACPP_AMX=1 keeps it).
CMAKE_ARGS=(-DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release)
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
if [[ "$FLAGS" == *" amx_tile "* && "${LLAMACPP_AMX:-0}" != 1 ]]; then
    CMAKE_ARGS+=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        [[ "$FLAGS" == *" ${pair%%:*} "* ]] && CMAKE_ARGS+=("-DGGML_${pair##*:}=ON")
    done
else
    CMAKE_ARGS+=(-DGGML_NATIVE=ON)
fi

have_all() {
    local t
    for t in "${TARGETS[@]}"; do
        [ -x "$BIN/$t" ] || return 1
    done
    # built with other flags (an older version of this script): configure and build again
    [ "$(cat "$DIR/build/.dspark-cmake-args" 2>/dev/null)" == "${CMAKE_ARGS[*]}" ]
}

if have_all; then
    log "tools already built in $BIN"
    echo "$BIN"
    exit 0
fi

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    log "installing cmake and g++ with apt"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update >&2
    $SUDO apt-get install -y cmake g++ make >&2
fi

if [ ! -f "$DIR/CMakeLists.txt" ]; then
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    log "downloading the llama-cpp-python sdist into $TMP"
    # --no-binary for this one package only: with :all: pip also builds the sdist's build
    # dependencies (scikit-build-core, setuptools, ...) from source just to read its metadata
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$TMP" >&2
    SDIST="$(ls "$TMP"/llama_cpp_python-*.tar.gz | head -n1)"
    log "unpacking vendor/llama.cpp from $(basename "$SDIST")"
    tar -xzf "$SDIST" -C "$TMP"
    SRC="$(ls -d "$TMP"/llama_cpp_python-*/vendor/llama.cpp | head -n1)"
    mkdir -p "$(dirname "$DIR")"
    rm -rf "$DIR"
    mv "$SRC" "$DIR"
    basename "$SDIST" >"$DIR/.dspark-source"
fi

cd "$DIR"
log "configuring in $DIR/build: ${CMAKE_ARGS[*]}"
cmake -B build "${CMAKE_ARGS[@]}" >&2
log "building ${TARGETS[*]} with -j$JOBS (about 10 minutes on 2 cores)"
cmake --build build -j"$JOBS" --target "${TARGETS[@]}" >&2
echo "${CMAKE_ARGS[*]}" >"$DIR/build/.dspark-cmake-args"
have_all || { log "build finished but some tools are missing from $BIN"; exit 1; }
log "tools in $BIN"
echo "$BIN"
