#!/usr/bin/env bash
# Build llama.cpp's benchmark tools from llama-cpp-python's source (the peer a CPU user picks), once per machine.
#
#   bash benchmarks/setup_llama_cpp.sh [--dry-run]
#
# Downloads the sdist of llama-cpp-python 0.3.36 (a package registry is all these machines reach), builds only
# `llama-bench` and `llama-batched-bench` from its vendored llama.cpp with -DGGML_NATIVE=ON, and prints the tree
# to pass as `--llama-cpp`. The build is cached outside the repository (HYBRIDKV_LLAMA_CACHE, default
# ~/.cache/hybridkv/llama.cpp); a second run only prints the path. On 2 cores the two targets took 4.5 minutes
# (AMD EPYC; the whole python package, ~35). `--dry-run` prints the steps and runs none of them.
set -euo pipefail

VERSION=0.3.36
CACHE=${HYBRIDKV_LLAMA_CACHE:-$HOME/.cache/hybridkv/llama.cpp}
SRC=$CACHE/llama_cpp_python-$VERSION
TREE=$SRC/vendor/llama.cpp
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1

step() {
    echo "+ $*"
    if [[ $DRY == 0 ]]; then "$@"; fi
}

if [[ -x $TREE/build/bin/llama-bench && -x $TREE/build/bin/llama-batched-bench ]]; then
    echo "llama.cpp tools already built: --llama-cpp $TREE"
    exit 0
fi
for tool in cmake g++ tar; do
    command -v "$tool" > /dev/null || { echo "setup_llama_cpp: '$tool' is missing; install it first" >&2; exit 1; }
done

step mkdir -p "$CACHE"
if [[ ! -d $SRC ]]; then
    step python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    step tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
step cmake -S "$TREE" -B "$TREE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF
step cmake --build "$TREE/build" -j "$JOBS" --target llama-bench llama-batched-bench
echo "llama.cpp tools built: --llama-cpp $TREE"
