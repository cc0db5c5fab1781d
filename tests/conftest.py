"""Eight fake CPU devices for the whole test session, set before JAX starts its backends.

The tests run on the CPU backend even where an accelerator exists (they need 8 devices of
one kind); the GPU checks are `jaxpar tour`, the benchmarks (benchmarks/gpu.py) and
`JAXPAR_TEST_PLATFORM=gpu pytest tests/kernels tests/gpu`, which runs on the GPUs.
"""

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile

# Before JAX starts: the tests' programs are small, so compiling them costs far more than
# running them, and code generation is most of the compile. Two backend flags cut it:
#   --xla_backend_optimization_level=0   no LLVM optimisation of the generated CPU code
#                                        (about a third of the suite's CPU time);
#   --xla_cpu_use_fusion_emitters=false  XLA:CPU's older emitters for fused loops (about
#                                        half of what was left on the MoE tests).
# Both act after XLA's HLO passes (collective combining, scheduling, buffer assignment),
# so the collectives and memory the tests count are the same programs' (`jaxpar verify
# memory` reads the same bytes with and without them). A flag this jaxlib does not know
# would abort XLA, so each is tried once in a small process first. The worker processes
# the tests start inherit the result (examples in subprocesses too: tests/test_examples.py);
# a flag the user set is kept.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flag: str) -> bool:
    probe = "import jax; jax.devices('cpu')"
    env = os.environ | {"XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0


for _flag in FAST_COMPILE:
    _name = _flag.split("=")[0]
    if _name not in os.environ.get("XLA_FLAGS", "") and _xla_accepts(_flag):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# The precision policy (jaxpar.testing.precision_policy) for the whole session and the
# processes it starts: float32 matmuls in float32, whose tolerances the tests hold results
# to. CPUs compute them so already; a GPU would use TF32 (a 10-bit mantissa) unless told.
# A precision the user set is kept.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# JAX's persistent compilation cache for the session and the processes it starts (both
# workers, the examples, the CLI's runs): a program compiled once (the same Trainer's step
# built again in a later test, in the other worker, in an example) is read back instead of
# compiled again. The tracing is not saved: tests that build one Trainer several times share
# it through the `trainers` fixture. A fresh directory per session, removed at its end (only
# this checkout's programs in it); a directory the user set is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

from jaxpar import mesh  # noqa: E402

# JAXPAR_TEST_PLATFORM=gpu runs the session on the machine's GPUs instead (the fused
# kernels' tests, tests/kernels, and the multi-GPU tests, tests/gpu, need them); the rest
# of the suite asks for 8 devices of one kind and runs on CPU.
ON_GPU = os.environ.get("JAXPAR_TEST_PLATFORM") == "gpu"
if ON_GPU:
    N_DEVICES = len(jax.devices())
else:
    jax.config.update("jax_platforms", "cpu")
    N_DEVICES = mesh.use_cpu_devices(8)  # XLA_FLAGS=--xla_force_host_platform_device_count wins


@pytest.fixture(scope="session")
def trainer_cache():
    """The session's `TrainerCache` (one per worker): tests that build the same Trainer (a
    parity run, then a look at its compiled step) pass it around and trace and compile that
    step once; the library keeps no Trainer between calls. (Imported here: the trainer's
    modules load after the devices are set.)"""
    from jaxpar.train.cache import TrainerCache
    return TrainerCache()


@pytest.fixture
def x64():
    """Run the test body with float64 enabled (jax_enable_x64), restoring it after."""
    with jax.enable_x64(True):
        yield


@pytest.fixture
def python_ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test body, as a command line
    starts with, whatever an earlier test in this worker process left installed; restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# The longest tests first. `make test` runs two xdist workers with --dist worksteal: each
# takes half of the ordered list and the one that finishes first takes half of what the
# other still has. With the longest tests (a minute or more: drawn trainings, examples in
# subprocesses, property tests) at the front, what is left to share at the end is short
# tests, and the two workers finish together. Order within each group is kept (a module's
# tests share compiled programs through module-level caches).
LONGEST_FIRST = (
    "tests/train/test_drawn.py",
    "tests/test_examples.py",
    "tests/context/test_properties.py",
    "tests/expert/test_properties.py",
    "tests/tensor/test_properties.py",
    "tests/train/test_checkpoint.py::test_sigkill",
    "tests/cli/test_train_multihost.py",
    "tests/train/test_zero3.py",
    "tests/train/test_parity.py",
    "tests/cli/test_train_cli.py",
    "tests/train/test_bf16.py",
    "tests/train/test_train.py",
    "tests/train/test_balance.py",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))
    items.sort(key=rank)     # stable: the collection order within a group
