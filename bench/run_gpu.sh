#!/usr/bin/env bash
# The NCCL transport's GPU checks on one host with 2 GPUs: the end-to-end benchmark (both
# communicator backends), the connector's path, then the gpu-marked tests (the direct backend's first, then the ipc backend's and torch's). Run from the project root with the wheels of `.whl/` present
# (pyzmq, msgspec, structlog, ...); logs and JSON go to $OUT (default /tmp/kvbroker-gpu), and with
# PACK=1 into one archive there instead, $OUT/gpu-run.tar.gz (one file to move or keep).
#   bash bench/run_gpu.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit
OUT=${OUT:-/tmp/kvbroker-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVB_TEST_OUT="$OUT"
set -o pipefail

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 - <<'EOF'
import datetime, torch, torch.distributed as dist
print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())
pg = dist.ProcessGroupNCCL
print("pg api:", {n: hasattr(pg, n) for n in ("abort", "_shutdown", "_start_coalescing", "_end_coalescing",
                                               "eager_connect_single_device", "bound_device_id")})
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
print("tcpstore port 0 ->", s.port)
from workers.transports import nccl_lib
from workers.transports.nccl import resolve_backend
lib = nccl_lib.load()
print("nccl_lib:", (lib.path, lib.version) if lib else nccl_lib.load_error(), "default backend:", resolve_backend())
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# BENCH_ARGS: the benchmark's flags (e.g. --diag, --backends torch, --ipc 132); by default the
# direct and ipc backends side by side, each row timed twice (--variants dup), which is the
# comparison docs/RESULTS.md still lacks on two GPUs; BENCH_ARGS="" for the benchmark's own
# defaults. SKIP_TESTS=1: no pytest.
# The timeouts keep one run under 9 minutes: the benchmark (about 100 s) gets BENCH_TIMEOUT,
# the connector's (about 25 s, and 20-25 s for each run with 8 in flight) CONNECTOR_TIMEOUT each, the direct backend's tests TEST_TIMEOUT,
# torch's whatever is left of TOTAL_BUDGET.
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-160}" python3 bench/nccl_transport.py --json "$OUT/nccl_transport.json" \
  ${BENCH_ARGS---backends direct,ipc --variants dup} 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?"
# The connector's own path (worker halves in two processes, a real broker) against raw NCCL.
timeout "${CONNECTOR_TIMEOUT:-90}" python3 bench/connector_path.py --transport nccl --json "$OUT/connector_nccl.json" \
  > "$OUT/connector_nccl.log" 2>&1
echo "connector bench rc=$?"
grep -v '^20\|^{' "$OUT/connector_nccl.log" | tail -5
# Eight requests of one step to one decode peer at once: a pair's transfers overlapping.
timeout "${CONNECTOR_TIMEOUT:-90}" python3 bench/connector_path.py --transport nccl --inflight 8 --tokens 2048,8192 \
  --iters 10 --json "$OUT/connector_nccl_inflight8.json" > "$OUT/connector_nccl_inflight8.log" 2>&1
echo "connector bench (8 in flight) rc=$?"
grep -v '^20\|^{' "$OUT/connector_nccl_inflight8.log" | tail -3
# The same eight after a 10 ms forward pass: what the transfers add once the prefill is done.
# JSON logs with each landing's wait for its load's lock and the broker's Prepare and Go (`kvbroker phases` reads them).
timeout "${CONNECTOR_TIMEOUT:-90}" python3 bench/connector_path.py --transport nccl --inflight 8 --tokens 512,2048 \
  --iters 10 --prefill-ms 10 --log-format json --log-level debug --broker-log-level debug --thread-cpu --json "$OUT/connector_nccl_inflight8_prefill10.json" \
  > "$OUT/connector_nccl_inflight8_prefill10.log" 2>&1
echo "connector bench (8 in flight, after a prefill) rc=$?"
grep -v '^20\|^{' "$OUT/connector_nccl_inflight8_prefill10.log" | tail -3
# BENCH_TORCH_DEBUG_ARGS: if set, a second run with torch's NCCL debug defaults left on
# (KVBROKER_NCCL_TORCH_DEBUG=1), to compare against the transport's quiet settings.
if [ -n "${BENCH_TORCH_DEBUG_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  KVBROKER_NCCL_TORCH_DEBUG=1 timeout "${BENCH_TIMEOUT:-90}" python3 bench/nccl_transport.py \
    --json "$OUT/nccl_transport-torchdebug.json" $BENCH_TORCH_DEBUG_ARGS 2>&1 | tee "$OUT/bench-torchdebug.log"
  echo "bench (torch debug defaults) rc=$?"
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/gpu -v -s -p no:cacheprovider -k "not torch and not ipc" 2>&1 \
    | tee "$OUT/pytest.log"
  echo "pytest (CPU and direct backend) rc=$?"
  # Then the ipc backend's and torch's, each in what is left of TOTAL_BUDGET.
  for backend in ipc torch; do
    left=$(( ${TOTAL_BUDGET:-520} - SECONDS ))
    if [ "$left" -gt 20 ]; then
      timeout "$left" python3 -m pytest tests/gpu -v -s -p no:cacheprovider -k "$backend" 2>&1 \
        | tee "$OUT/pytest-$backend.log"
      echo "pytest ($backend backend) rc=$?"
    else
      echo "pytest ($backend backend) skipped: ${left} s left"
    fi
  done
  # The connector's GPU tests once more over the ipc backend (its own names do not say "ipc"),
  # set as a mixed cluster would set it: ipc within a host, direct NCCL between hosts.
  left=$(( ${TOTAL_BUDGET:-520} - SECONDS ))
  if [ "$left" -gt 20 ]; then
    KVBROKER_NCCL_BACKEND=ipc,direct timeout "$left" python3 -m pytest tests/gpu/test_connector_nccl.py -v -s \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest-connector-ipc.log"
    echo "pytest (the connector over the ipc backend) rc=$?"
  fi
fi
if [ "${PACK:-0}" = 1 ]; then
  ( cd "$OUT" && files=$(ls -A | grep -v '^gpu-run.tar.gz$') \
      && tar -czf gpu-run.tar.gz $files && rm -rf $files ) && echo "packed into $OUT/gpu-run.tar.gz"
fi
