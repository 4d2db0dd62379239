#!/usr/bin/env bash
# The GPU lane in one prepared command, for a bare GPU machine that has torch (any CUDA build) and none of this
# project's other dependencies. Prepare here: `bash scripts/device_wheels.sh` (wheels into .whl/, ~21 MiB); then
# run there from the repository root, carrying .whl:
#
#   bash scripts/device_check.sh            # about 8 minutes on one H100/H200; every step has its own limit
#   bash scripts/device_check.sh --dry-run  # here, on CPU: prints the steps, checks that what they name exists
#
# Steps; each prints its result, and the logs land in $OUT (the device tool's folder) or /tmp/device_check:
#   1. wheels   .whl/*.whl into /tmp/site (no index: nothing can be fetched there)
#   2. machine  nvidia-smi, torch, the GPU torch sees
#   3. tests    the tests that need no CPU kernel, on CUDA (HYBRIDKV_DEVICE=cuda)
#   4. matrix   the exactness suites of tests/test_exactness_matrix.py, on CUDA; PD needs nixl-cu12, whose
#               libraries (~220 MiB) exceed what a call carries (64 MiB): its suites are listed, not run
#   5. bench    bench_shapes.py --device cuda against transformers on the same GPU, with the bandwidth bound
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[[ ${1:-} == --dry-run ]] && DRY=1
LOGS=${OUT:-/tmp/device_check}
mkdir -p "$LOGS"
export HYBRIDKV_DEVICE=cuda PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="/tmp/site:$PWD"

CUDA_TESTS=(  # engines, schedulers and connectors on the device; every kernel test here has a torch path
    tests/engine/test_device.py
    tests/engine/test_parity.py
    tests/engine/test_chunking.py
    tests/engine/test_request_isolation.py
    tests/engine/test_int8_state.py
    tests/models/test_qwen3_5.py
    tests/models/test_nemotron_h.py
    tests/models/test_gemma3.py
)
MATRIX=(tests/engine/test_exact_hybrid.py tests/engine/test_exact_attention.py tests/offload/test_offload_hybrid.py
        tests/offload/test_offload_exact_attention.py)  # fmt: the exactness matrix's suites that run without NIXL
NOT_HERE=(tests/pd/test_pd_hybrid.py tests/pd/test_pd_exact_attention.py)
BENCH=(benchmarks/bench_shapes.py --device cuda --engines hybridkv,transformers --shapes qwen3-0.6b,gemma3-270m
       --dtypes bfloat16 --contexts 4096 --repeats 2 --threads 4)

status=0
step() {  # step NAME LIMIT_S COMMAND...: run with its own time limit, log it, and say how it ended
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    [[ $DRY == 1 ]] && return 0
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    echo "== $name: exit $rc"
    [[ $rc == 0 ]] || status=1
}

if [[ $DRY == 1 ]]; then  # what the steps name must exist, and the benchmark must take its flags
    missing=0
    for f in "${CUDA_TESTS[@]}" "${MATRIX[@]}" "${NOT_HERE[@]}" benchmarks/bench_shapes.py scripts/device_wheels.sh; do
        [[ -e $f ]] || { echo "device_check: $f does not exist" >&2; missing=1; }
    done
    for suite in "${MATRIX[@]}" "${NOT_HERE[@]}"; do
        grep -q "\"$suite\"" tests/test_exactness_matrix.py || { echo "device_check: $suite is not a matrix suite" >&2; missing=1; }
    done
    help=$(python benchmarks/bench_shapes.py --help) || missing=1
    for flag in "${BENCH[@]}"; do
        [[ $flag != --* || $help == *"$flag"* ]] || { echo "device_check: bench_shapes has no $flag" >&2; missing=1; }
    done
    [[ $missing == 0 ]] || exit 1
fi

step wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
step machine 60 bash -c 'nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda,
    torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 30, \"GiB\")"'
step tests 150 python3 -m pytest -q -x -p no:cacheprovider "${CUDA_TESTS[@]}"
step matrix 210 python3 -m pytest -q -p no:cacheprovider -k "not lm_eval" "${MATRIX[@]}"
echo "== not run on the device (need nixl-cu12): ${NOT_HERE[*]}"
step bench 180 python3 "${BENCH[@]}"
[[ $DRY == 1 ]] && echo "dry run: every step above is ready"
exit $status
