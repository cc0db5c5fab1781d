#!/usr/bin/env bash
# One prepared GPU session: the tour, the GPU tests, the GPU benchmark and the PyTorch
# side by side, each bounded in time, their output under $OUT (or ./gpu-out). Run from
# the repository root on the GPU machine, with its own python3 (jax, flax, optax, orbax,
# torch installed) and jaxpar from the source tree:
#
#   JAXPAR_COMMIT=$(git rev-parse --short HEAD) benchmarks/gpu_check.sh [tour] [tests] [bench] [torch]
#
# With no argument every part runs. The tour and the tests share the GPU without
# preallocating; the benchmarks run alone, afterwards. BENCH_ARGS adds to benchmarks.gpu's.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
parts=${*:-tour tests bench torch}
has() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if has tour || has tests; then
  if has tour; then
    ( XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TOUR_S:-170} python3 -m jaxpar tour > "$OUT/tour.txt" 2>&1
      echo "tour exit $?" >> "$OUT/tour.txt" ) &
  fi
  if has tests; then
    ( XLA_PYTHON_CLIENT_PREALLOCATE=false JAXPAR_TEST_PLATFORM=gpu timeout ${TESTS_S:-170} \
        python3 -m pytest -q -p no:cacheprovider -rs tests/kernels tests/gpu > "$OUT/tests.txt" 2>&1
      echo "tests exit $?" >> "$OUT/tests.txt" ) &
  fi
  wait
  has tests && tail -25 "$OUT/tests.txt"
  has tour && grep -E " NO | skip |tour exit|^technique" "$OUT/tour.txt" | cut -c1-220 && tail -3 "$OUT/tour.txt" | cut -c1-300
fi
if has bench; then
  timeout ${BENCH_S:-200} python3 -m benchmarks.gpu --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 | grep -v "^W0000\|^I0000" | cut -c1-200
fi
if has torch; then
  timeout ${TORCH_S:-200} python3 -m benchmarks.torch_peer --quick --out "$OUT" 2>&1 | tail -30 | cut -c1-200
fi
ls -la "$OUT"
