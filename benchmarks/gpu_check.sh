#!/usr/bin/env bash
# One prepared GPU session: the tour, the GPU tests, the GPU benchmark and the PyTorch
# side by side, each bounded in time, their output under $OUT (or ./gpu-out). Run from
# the repository root on the GPU machine, with its own python3 (jax, flax, optax, orbax,
# torch installed) and jaxpar from the source tree:
#
#   JAXPAR_COMMIT=$(git rev-parse --short HEAD) benchmarks/gpu_check.sh [tour] [checks] [tests] [attention] [expert] [bench] [torch]
#
# With no argument tour, tests, attention, expert, bench and torch run, one after the other;
# `pending` is what no GPU has run yet (tests, expert, the MoE both ways, the ep check). `tour` is
# `python -m jaxpar tour` in one call (TOUR_S seconds at most), its exit status last in
# $OUT/tour.txt; `checks` runs the same checks as `jaxpar verify NAME` one by one (CHECK_S
# seconds each), appending to $OUT/checks.txt, so a call cut short keeps what finished. The
# tests, the tour and the checks do not preallocate the GPU, so the tour can run beside the
# benchmark. BENCH_ARGS adds to benchmarks.gpu's (e.g. --only 1B-T8192,1B-T32768-dots),
# TORCH_ARGS to benchmarks.torch_peer's (e.g. --size 1B), TESTS replaces the test files,
# CHECKS names the checks (default: every one of the tour).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
parts=${*:-tour tests attention expert bench torch}
if [[ " $parts " == *" pending "* ]]; then   # what no GPU has run yet: the Pallas kernels' tests, the
  # experts' kernel one layer at a time, the MoE both ways, and the tour's rows new since the
  # GPU ran it (the ep check's grouped-kernel row; the trainer itself is the program the GPU
  # timed: benchmarks/gpu_program.py)
  parts="$parts tests expert bench checks"
  BENCH_ARGS=${BENCH_ARGS:---only MoE --compare-experts MoE --steps 5}
  CHECKS=${CHECKS:-ep}
fi
has() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if has tour; then      # the whole tour, one process, as a user runs it
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TOUR_S:-300} python3 -m jaxpar tour > "$OUT/tour.txt" 2>&1
  rc=$?; echo "== jaxpar tour exit $rc" >> "$OUT/tour.txt"; grep -E " NO |Error|exit" "$OUT/tour.txt" | cut -c1-220
fi
if has checks; then    # check by check, appended to one file: a run cut short keeps every finished check
  : > "$OUT/checks.txt"
  for c in ${CHECKS:-$(python3 -c "from jaxpar.cli.tour import CHECKS; print(' '.join(CHECKS))")}; do
    s=$(date +%s)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${CHECK_S:-120} python3 -m jaxpar verify "$c" >> "$OUT/checks.txt" 2>&1
    rc=$?; echo "== $c exit $rc in $(( $(date +%s) - s )) s" >> "$OUT/checks.txt"
    echo "$c exit $rc in $(( $(date +%s) - s )) s"
  done
  grep -E " NO |Error" "$OUT/checks.txt" | cut -c1-220
fi
if has tests; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAXPAR_TEST_PLATFORM=gpu timeout ${TESTS_S:-240} \
      python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/kernels/test_flash.py tests/kernels/test_grouped.py tests/kernels/test_attention.py tests/gpu} > "$OUT/tests.txt" 2>&1
  echo "tests exit $?" >> "$OUT/tests.txt"; tail -25 "$OUT/tests.txt"
fi
if has attention; then  # the attention implementations, forward + backward (fused kernels against XLA)
  timeout ${ATTN_S:-90} python3 -m benchmarks.attention_gpu --out "$OUT" 2>&1 | grep -v "^W0000\|^I0000" | cut -c1-200
fi
if has expert; then     # one MoE layer, forward + backward (the grouped kernel against XLA's grouped and padded)
  timeout ${EXPERT_S:-90} python3 -m benchmarks.expert_gpu --out "$OUT" 2>&1 | grep -v "^W0000\|^I0000" | cut -c1-200
fi
if has bench; then       # the census of the program timed (benchmarks/gpu_program.py), then the timings
  timeout 90 python3 -m benchmarks.gpu_program --out "$OUT" 2>&1 | grep -v "^W0000\|^I0000" | cut -c1-200
  timeout ${BENCH_S:-200} python3 -m benchmarks.gpu --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v "^W0000\|^I0000" | cut -c1-200
fi
if has torch; then
  timeout ${TORCH_S:-200} python3 -m benchmarks.torch_peer --quick --out "$OUT" ${TORCH_ARGS:-} 2>&1 | tail -30 | cut -c1-200
fi
ls -la "$OUT"
