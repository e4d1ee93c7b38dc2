#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source vendored inside the llama-cpp-python sdist.
# The binary is cached outside the repo, keyed by the sdist version:
#   ${PACELINE_PEERS_DIR:-~/.cache/paceline/peers}/llama-server-<version>/llama-server
# It is a benchmark peer, not a dependency: never run this in CI.
# Usage: benchmarks/build_llama_server.sh [version]   (default: the newest on PyPI)
# Built with one job at lowest priority so it does not starve other work on a shared machine.
set -euo pipefail

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
PEERS=${PACELINE_PEERS_DIR:-$HOME/.cache/paceline/peers}
JOBS=${JOBS:-1}
SPEC="llama-cpp-python${1:+==$1}"

work=$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$PY" -m pip download --quiet --no-binary :all: --no-deps "$SPEC" -d "$work"
sdist=$(ls "$work"/llama_cpp_python-*.tar.gz)
version=$(basename "$sdist" .tar.gz); version=${version#llama_cpp_python-}
dest="$PEERS/llama-server-$version"
if [ -x "$dest/llama-server" ]; then
    echo "$dest/llama-server"   # already built
    exit 0
fi

tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
# -DLLAMA_CURL=OFF: no network code; GGML_NATIVE: use this CPU's AVX-512/BF16
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
nice -n 19 cmake --build "$work/build" --target llama-server -j "$JOBS" >&2

mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$dest/llama-server"
echo "$version" > "$dest/VERSION"
echo "$dest/llama-server"
