"""Session-wide test setup: 8 virtual CPU devices for the mesh tests, set before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are small and run once or a few times: compiling them is most of the suite's time,
# and XLA's CPU backend compiles them faster with LLVM's optimisation off; the programs compute the same
# functions (the HLO passes all run).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
