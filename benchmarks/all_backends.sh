#!/usr/bin/env bash
# The tour and the benchmarks on whatever backend JAX finds: the GPUs/TPUs of this
# machine when it has some, else the CPU with 8 fake devices (--devices only affects CPU,
# so nothing is forced onto the CPU when an accelerator is present).
#
#   benchmarks/all_backends.sh            tour + every benchmark
#   PYTHON=python3 benchmarks/all_backends.sh comms    tour + the named benchmarks
#
# Exit status: 0 when the tour's checks all pass and the benchmarks ran, else the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

"$PY" - <<'PYEOF'
import jax
devs = jax.devices()
print(f"JAX {jax.__version__}: {len(devs)} x {devs[0].platform} ({devs[0].device_kind}), "
      f"{jax.process_count()} process(es)")
PYEOF

echo; echo "== jaxpar tour"
"$PY" -m jaxpar tour
tour_rc=$?

echo; echo "== benchmarks"
"$PY" -m benchmarks.run "$@"
bench_rc=$?

echo; echo "tour exit $tour_rc, benchmarks exit $bench_rc"
[ "$tour_rc" -ne 0 ] && exit "$tour_rc"
exit "$bench_rc"
