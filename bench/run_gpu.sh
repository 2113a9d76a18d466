#!/usr/bin/env bash
# Everything that needs a GPU, in one call: the GPU tests, the connector's own path
# (bench/connector_path.py) and, if NIXL is importable, NIXL's transfer on the same GPU(s)
# (bench/nixl_peer.py), which docs/PERFORMANCE.md tabulates. Run from the project root;
# wheels in .whl/ (pyzmq, msgspec, structlog, ..., and nixl-cu13==1.5.1 for the peer, whose
# own needs, torch and numpy, a CUDA host has) are installed first when present. Outputs
# go to $OUT (default /tmp/kvbroker-gpu); with PACK=1 into one archive there,
# $OUT/gpu-run.tar.gz.
#   bash bench/run_gpu.sh
# On one GPU the backend is ipc (both caches on cuda:0); with two, BACKEND (default
# "ipc,direct" for the tests, direct for the benchmark) picks it.
if [ -n "${WHEELS_INSTALLED:-}" ]; then  # the caller installed them already (PYTHONPATH set)
  :
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/kvbroker-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVB_TEST_OUT="$OUT"
set -o pipefail
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" = 1 ]; then
  TEST_BACKEND=ipc BENCH_BACKEND=ipc
else
  TEST_BACKEND=${BACKEND:-ipc,direct} BENCH_BACKEND=${BACKEND:-direct}
fi

{
  date -u +%Y-%m-%dT%H:%MZ
  git log -1 --format='commit %h %s' 2>/dev/null || echo "commit: not a git checkout"
  # What ran, whatever the checkout's git state: compare with the same line on a commit.
  echo "sources sha1 $(find broker connector protocols workers bench -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'EOF'
import torch
from workers.transports import nccl_lib
from workers.transports.nccl_setup import resolve_backend
lib = nccl_lib.load()
print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nccl_lib",
      (lib.path, lib.version) if lib else nccl_lib.load_error(), "default backend", resolve_backend())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The tests: every gpu-marked test, over the ipc backend on one GPU (the two-GPU ones skip);
# with two GPUs over TEST_BACKEND, then the connector's over direct NCCL as well. A test
# still running after TEST_STALL_S has every thread's stack written to the log (pytest's
# faulthandler), so a hang says where it waits before the timeout ends the run.
STALL="-o faulthandler_timeout=${TEST_STALL_S:-60}"
KVBROKER_NCCL_BACKEND=$TEST_BACKEND timeout "${TEST_TIMEOUT:-300}" python3 -m pytest tests/gpu -v -s $STALL \
  -p no:cacheprovider 2>&1 | grep -v '^20[0-9][0-9]-.*\[\(info\|debug\)' | tee "$OUT/pytest.log"
echo "pytest (KVBROKER_NCCL_BACKEND=$TEST_BACKEND) rc=$?"
if [ "$GPUS" -ge 2 ]; then  # the connector's tests (the race among them) over direct NCCL too
  KVBROKER_NCCL_BACKEND=direct timeout "${TEST_TIMEOUT:-300}" python3 -m pytest tests/gpu/test_connector_nccl.py -v -s \
    $STALL -p no:cacheprovider 2>&1 | grep -v '^20[0-9][0-9]-.*\[\(info\|debug\)' | tee "$OUT/pytest-direct.log"
  echo "pytest connector (KVBROKER_NCCL_BACKEND=direct) rc=$?"
fi

# The connector's path: one request, after a 20 ms prefill, and eight of one step at once.
# On one GPU D's step is a sleep by default (see bench/connector_path.py).
bench() {  # NAME ARGS...: one run of bench/connector_path.py, its table on stdout, JSON and log in $OUT
  local name=$1
  shift
  timeout "${BENCH_TIMEOUT:-150}" python3 bench/connector_path.py --transport nccl --backend "$BENCH_BACKEND" \
    --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name ($*) rc=$?"
  grep -v '^20[0-9][0-9]-\|^{' "$OUT/$name.log" | tail -5
}
bench connector --tokens 512,2048,8192 --iters 20
bench connector_prefill20 --tokens 512,2048,8192 --iters 20 --prefill-ms 20
bench connector_inflight8 --tokens 512,2048 --iters 20 --inflight 8
bench connector_inflight8_prefill20 --tokens 512,2048 --iters 20 --inflight 8 --prefill-ms 20
# The same forward pass as matrix multiplies on every SM: what the copies cost a real prefill.
bench connector_prefill20_gemm --tokens 512,2048,8192 --iters 20 --prefill-ms 20 --forward gemm
bench connector_inflight8_prefill20_gemm --tokens 512,2048 --iters 20 --inflight 8 --prefill-ms 20 --forward gemm

# What the gathers that materialize the KV cost a forward pass on this GPU, with and
# without a copy of the same bytes beside them (the sends' share of its memory).
timeout "${BENCH_TIMEOUT:-150}" python3 bench/gather_stretch.py --json "$OUT/gather_stretch.json" 2>&1 \
  | tee "$OUT/gather_stretch.log"
echo "gather_stretch rc=$?"

# The ipc copy into D's blocks by itself: its rate on its programs, and its cost to matrix
# multiplies beside it, against the kernel's previous step.
timeout "${BENCH_TIMEOUT:-150}" python3 bench/copy_kernels.py --json "$OUT/copy_kernels.json" 2>&1 \
  | tee "$OUT/copy_kernels.log"
echo "copy_kernels rc=$?"

# The peer, on the same GPU(s), beside the connector's rows of this run.
if python3 -c 'import sys; sys.path.insert(0, "bench"); import nixl_peer; sys.exit(nixl_peer.nixl_module() is None)'; then
  timeout "${NIXL_TIMEOUT:-300}" python3 bench/nixl_peer.py --tokens 512,2048,8192 --iters 20 \
    --against "$OUT/connector.json" --json "$OUT/nixl.json" 2>&1 | grep -v '^20[0-9][0-9]-' | tee "$OUT/nixl.log"
  echo "nixl_peer rc=$?"
else
  echo "nixl is not importable here: bench/nixl_peer.py skipped (carry the nixl-cu13 wheel in .whl/)" | tee "$OUT/nixl.log"
fi

if [ "${PACK:-0}" = 1 ]; then
  ( cd "$OUT" && files=$(ls -A | grep -v '^gpu-run.tar.gz$') \
      && tar -czf gpu-run.tar.gz $files && rm -rf $files ) && echo "packed into $OUT/gpu-run.tar.gz"
fi
