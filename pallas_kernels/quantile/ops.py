"""The exact quantile balance's pieces with an implementation choice: input checks and dispatch.

    c_MN = choice_margins(scores_MN, bias_N, k)             # s - (k-th largest of s + b over the others)
    t_N  = exact_threshold(values_MN, num_above)            # per column, the midpoint that q entries exceed
    t_N  = margin_threshold(scores_MN, bias_N, k, num_above)  # exact_threshold(choice_margins(...))

`implementation`: None picks "pallas" on GPU and "xla" elsewhere; "xla" runs reference.py; "pallas" the
Triton-lowered kernels of kernel.py (GPU only); "interpret" the same kernels in Pallas interpret mode
(how CI tests them on the CPU). Every implementation gives the same bits. No gradients: the balance runs
on stop_gradient'ed router scores, so there is no custom VJP and jax.grad through "pallas" fails.
On the H200 the XLA form of one sweep at the step's shape ([32768, 64], k=8) takes 0.24 ms, mostly
lax.top_k and the radix selection's 16 small reductions (launch-bound); the kernels do a sweep in two
launches (BENCHMARKS.md, "Quantile balance kernels", once benchmarks/quantile.py has written it).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.backend import require_gpu
from pallas_kernels.quantile import kernel, reference
from pallas_kernels.quantile.kernel import Blocks

IMPLEMENTATIONS = ("xla", "pallas", "interpret")


def resolve_implementation(implementation) -> str:
  """None -> "pallas" on GPU, "xla" elsewhere; raises ValueError for an unknown name or "pallas" off GPU."""
  if implementation is None:
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown quantile balance implementation {implementation!r}; expected one of "
                     f"{IMPLEMENTATIONS} or None")
  if implementation == "pallas":
    require_gpu("quantile balance", "'interpret' to run the kernels on the CPU or 'xla'")
  return implementation


def _check_margins(scores_MN, bias_N, k, kernels: bool):
  if getattr(scores_MN, "ndim", None) != 2:
    raise ValueError(f"choice_margins: scores must be [tokens, experts], got shape "
                     f"{getattr(scores_MN, 'shape', None)}")
  n = scores_MN.shape[1]
  if getattr(bias_N, "shape", None) != (n,):
    raise ValueError(f"choice_margins: bias shape {getattr(bias_N, 'shape', None)} does not match "
                     f"{n} experts")
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < n:
    raise ValueError(f"choice_margins: k={k!r} must be an int in [1, num_experts - 1 = {n - 1}] "
                     f"(the (k+1)-th largest score must exist)")
  if kernels and (scores_MN.dtype != jnp.float32 or bias_N.dtype != jnp.float32):
    raise ValueError(f"choice_margins kernels take float32 scores and bias, got {scores_MN.dtype} and "
                     f"{bias_N.dtype}")


def _check_values(values_MN):
  if getattr(values_MN, "ndim", None) != 2 or values_MN.shape[0] < 1:
    raise ValueError(f"exact_threshold: values must be [rows >= 1, columns], got shape "
                     f"{getattr(values_MN, 'shape', None)}")


def choice_margins(scores_MN, bias_N, k: int, *, implementation=None, blocks: Blocks | None = None):
  """reference.choice_margins: c_ij = s_ij - (k-th largest of s_il + b_l over l != j), [M, N]; with
  the kernels, scores and bias must be float32."""
  implementation = resolve_implementation(implementation)
  _check_margins(scores_MN, bias_N, k, implementation != "xla")
  if implementation == "xla" or scores_MN.shape[0] == 0:
    return reference.choice_margins(scores_MN, bias_N, k)
  (c_MN,) = _margins_jit(scores_MN, bias_N, k, blocks or Blocks(), True, False, implementation == "interpret")
  return c_MN


def exact_threshold(values_MN, num_above: float, *, implementation=None, blocks: Blocks | None = None):
  """reference.exact_threshold: per column, the midpoint of the q-th and (q+1)-th largest entries
  (the q-th itself when tied), q = round(num_above) clipped to [1, rows - 1]; [N] float32 (one row:
  that row as it is). The kernels read the columns' order keys, made here by one XLA transpose."""
  implementation = resolve_implementation(implementation)
  _check_values(values_MN)
  if implementation == "xla" or values_MN.shape[0] == 1:
    return reference.exact_threshold(values_MN, num_above)
  keys_NM = reference.ordered_key(values_MN.astype(jnp.float32).T)
  q = reference.threshold_rank(values_MN.shape[0], num_above)
  return _threshold_jit(keys_NM, q, blocks or Blocks(), implementation == "interpret")


def margin_threshold(scores_MN, bias_N, k: int, num_above: float, *, implementation=None,
                     blocks: Blocks | None = None):
  """exact_threshold(choice_margins(scores, bias, k), num_above): one sweep of quantile balancing,
  [N] float32. With the kernels the margins never reach memory as [M, N]: the margins kernel writes
  only their order keys, column by column, for the threshold kernel."""
  implementation = resolve_implementation(implementation)
  _check_margins(scores_MN, bias_N, k, implementation != "xla")
  _check_values(scores_MN)
  if implementation == "xla" or scores_MN.shape[0] == 1:
    return reference.exact_threshold(reference.choice_margins(scores_MN, bias_N, k), num_above)
  blocks, interpret = blocks or Blocks(), implementation == "interpret"
  (keys_NM,) = _margins_jit(scores_MN, bias_N, k, blocks, False, True, interpret)
  return _threshold_jit(keys_NM, reference.threshold_rank(scores_MN.shape[0], num_above), blocks, interpret)


# quantile_bias calls these once per sweep and MoE layer with the same shapes: jitted, each kernel is
# traced and lowered (Pallas -> Triton) once and reused.
def _margins(scores_MN, bias_N, k, blocks, write_margins, write_keys, interpret):
  return kernel.margins_pallas(scores_MN, bias_N, k, blocks=blocks, write_margins=write_margins,
                               write_keys=write_keys, interpret=interpret)


def _threshold(keys_NM, q, blocks, interpret):
  return kernel.threshold_pallas(keys_NM, q, blocks=blocks, interpret=interpret)


_margins_jit = jax.jit(_margins, static_argnums=(2, 3, 4, 5, 6))
_threshold_jit = jax.jit(_threshold, static_argnums=(1, 2, 3))
