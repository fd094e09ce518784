"""Session-wide test setup: 8 virtual CPU devices for the mesh tests, set before JAX starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
