"""Session-wide test setup: 8 virtual CPU devices for the mesh tests, set before JAX starts."""

import hashlib
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs (the tiny model's steps, the same shapes in several tests and in
# the subprocesses some of them start): XLA's persistent cache, shared by the workers and subprocesses of
# a run (they inherit the environment) and kept between runs of this checkout, compiles each once.
_checkout = hashlib.sha256(os.path.dirname(os.path.abspath(__file__)).encode()).hexdigest()[:12]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"moejax-test-xla-cache-{_checkout}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # bytes; the oldest entries go
# The tests' programs are small and run once or a few times: compiling them is most of the suite's time,
# and XLA's CPU backend compiles them faster with LLVM's optimisation off; the programs compute the same
# functions (the HLO passes all run).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

