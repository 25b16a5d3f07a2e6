#!/usr/bin/env bash
# Build llama.cpp's `llama-server` once, from the llama.cpp tree vendored in the
# `llama-cpp-python` sdist (PyPI is the only source of C++ code reachable here), and a
# small virtualenv in which its GGUF converter runs.
#
# Why llama-server and not the Python wrapper's server: only llama-server batches
# concurrent requests (`-np`). Idempotent: an existing binary is kept. ~6 min on 2 cores.
#
#   benchmarks/baselines/llamacpp.sh
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${PIE_BASELINES:-$HOME/.cache/pie/baselines}"
SRC="$ROOT/llama.cpp-$VERSION"
BIN="$SRC/build/bin/llama-server"
VENV="$ROOT/llama.cpp-venv"  # for convert_hf_to_gguf.py: Pie's packages + sentencepiece

if [[ -x "$BIN" && -x "$VENV/bin/python" ]]; then
    echo "llama-server already built: $BIN"
    exit 0
fi

mkdir -p "$ROOT"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    echo "==> downloading llama-cpp-python==$VERSION sdist"
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        "llama-cpp-python==$VERSION" -d "$TMP"
    tar xzf "$TMP"/llama_cpp_python-*.tar.gz -C "$TMP"
    rm -rf "$SRC"
    mv "$TMP"/llama_cpp_python-*/vendor/llama.cpp "$SRC"
fi

echo "==> building llama-server (cmake, Release, native CPU; several minutes)"
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$SRC/build" --target llama-server -j "$(nproc)"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "==> converter virtualenv $VENV (system packages + sentencepiece)"
    python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check sentencepiece
fi
echo "llama-server ready: $BIN"
