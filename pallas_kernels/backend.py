"""The one check every op makes before it lowers its kernels for a GPU."""

import jax


def require_gpu(op: str, other_choices: str = "'interpret' to run the same kernels on the CPU"):
  """Raises unless JAX's default backend is a GPU: the kernels lower through Triton only there.

  `op` names the caller in the message; `other_choices` says what the caller offers instead.
  """
  backend = jax.default_backend()
  if backend != "gpu":
    raise ValueError(f"{op} implementation='pallas' needs a GPU backend, not {backend!r}; "
                     f"use {other_choices}")
