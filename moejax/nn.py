"""Small building blocks shared by every layer: logical-axis params, RMSNorm, dense projections.

Parameters carry MaxText-style logical axis names (`embed`, `heads`, `mlp`, ...) through
`nn.with_logical_partitioning`; the mapping from logical names to mesh axes lives in
`moejax/parallel/mesh.py`, never in the math.
"""

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Axes = tuple[str | None, ...]

# The checkpoint name of every `matmul` output, for remat policies.
MATMUL_NAME = "matmul"

# The leading logical axis of the params of scanned layers (moejax/model.py): a batch of layers.
LAYERS_AXIS = "layers"


def layers_lead(names: Axes) -> int:
  """How many leading axes of a param with these logical names stack scanned layers: 1 or 0."""
  return 1 if names[:1] == (LAYERS_AXIS,) else 0


def kernel_init(num_in_axes: int, ndim: int):
  """Fan-in init for a kernel whose first `num_in_axes` axes are contracted with the input.

  Spelled out because flax's default takes axis -2 as the input axis, which is wrong for
  [in, heads, dim] kernels (fan_in would come out as `heads`).
  """
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=tuple(range(num_in_axes)),
      out_axis=tuple(range(num_in_axes, ndim)))


default_kernel_init = kernel_init(1, 2)  # [in, out] matrices


def _einsum_parts(spec: str) -> tuple[str, str, str]:
  inputs, arrow, out = spec.replace(" ", "").partition("->")
  a, comma, b = inputs.partition(",")
  if not (arrow and comma) or "." in spec or not all(s.isalpha() for s in (a, b, out)):
    raise ValueError(f"matmul wants an explicit two-operand einsum 'ab,bc->ac', got {spec!r}")
  for name, own, others in (("x", a, b + out), ("w", b, a + out), ("output", out, a + b)):
    if lone := set(own) - set(others):
      # Then the gradient einsums below would not be the transposes of this one.
      raise ValueError(f"matmul {spec!r}: {name} index {sorted(lone)} appears nowhere else")
  return a, b, out


def _dot_dtype(out_dtype) -> jnp.dtype:
  """The type a dot writes when its result is wanted in out_dtype: out_dtype itself when it is narrower
  than float32, else float32.

  The GEMMs accumulate bf16 (and f16) products in float32 whatever type they write, so writing the
  narrow type directly is the same number in half the bytes: on the CPU bit-identical to rounding a
  float32 result (tests/test_nn.py); XLA's Triton GEMMs add split-K partial sums in float32 too (seen in
  a deviceless H200 compile); cuBLASLt may, for some shapes, pick a split-K reduction in the output type
  (not checked), which would add one bf16 rounding per partial sum. Writing float32 and casting after is not:
  XLA:GPU keeps the cuBLAS output in float32 and, allowed excess precision, removes the cast's round
  trip whenever the consumer widens again, so the consumer reads the float32 tensor (the H200 step's
  pre-norm backward read its projections' dx that way; BENCHMARKS.md, "Step HBM traffic").
  """
  out_dtype = jnp.dtype(out_dtype)
  return out_dtype if jnp.finfo(out_dtype).bits < 32 else jnp.dtype(jnp.float32)


def _dot(spec: str, x, w, out_dtype, out_sharding=None):
  """einsum with float32 accumulation, the result in out_dtype (`_dot_dtype` says how it is written)."""
  y = jnp.einsum(spec, x, w, preferred_element_type=_dot_dtype(out_dtype), out_sharding=out_sharding)
  return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _lowp_einsum(spec: str, x, w, out_dtype):
  return _dot(spec, x, w.astype(x.dtype), out_dtype)


def _lowp_einsum_fwd(spec, x, w, out_dtype):
  return _lowp_einsum(spec, x, w, out_dtype), (x, w)


def _lowp_einsum_bwd(spec, out_dtype, residuals, dy):
  x, w = residuals
  a, b, out = _einsum_parts(spec)
  dy = dy.astype(x.dtype)
  dx = _dot(f"{out},{b}->{a}", dy, w.astype(x.dtype), x.dtype, _explicit_sharding(x))
  dw = _dot(f"{a},{out}->{b}", x, dy, w.dtype, _explicit_sharding(w))
  return dx, dw


def _explicit_sharding(like):
  """like's sharding on an Explicit mesh, where a contraction over a sharded axis must be told where its
  result goes (as autodiff tells the transposes of a dot); None otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Explicit not in set(mesh.axis_types):
    return None
  # The spec alone, on the ambient mesh: an array that came in unsharded has a type without a mesh.
  return jax.typeof(like).sharding.spec


_lowp_einsum.defvjp(_lowp_einsum_fwd, _lowp_einsum_bwd)


def matmul(spec: str, x, w, dtype, out_dtype=None):
  """einsum of x and w in the compute dtype with float32 accumulation; the result in out_dtype
  (default: dtype). `spec` is an explicit contraction like "btd,dhk->bthk".

  The backward pass runs in the compute dtype too: the incoming gradient is cast to it, so both of its
  matmuls are, for bf16 compute, bf16 GEMMs (plain autodiff would hand them the float32 gradient of the
  float32 accumulator and make them float32 GEMMs, which run at the TF32 rate or below). The weight
  gradient is accumulated and returned in float32 (w's dtype), x's in the compute dtype.
  """
  _einsum_parts(spec)
  x, w = same_varying_axes(x.astype(dtype), w)
  # Named, because a remat policy cannot see the dot inside the custom VJP (model.DOTS_POLICY saves it).
  return checkpoint_name(_lowp_einsum(spec, x, w, jnp.dtype(out_dtype or dtype)), MATMUL_NAME)


def _varying_axes(x) -> frozenset:
  """The shard_map mesh axes over which x varies (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def same_varying_axes(x, w):
  """Inside shard_map, marks each operand as varying over the axes the other varies over, as a plain
  einsum does implicitly: a custom VJP's gradient must vary exactly as its operand does, and the
  transpose of this cast sums a replicated weight's gradient over the shards."""
  vx, vw = _varying_axes(x), _varying_axes(w)
  if vx - vw:
    w = jax.lax.pcast(w, tuple(sorted(vx - vw)), to="varying")
  if vw - vx:
    x = jax.lax.pcast(x, tuple(sorted(vw - vx)), to="varying")
  return x, w


def check_input(x_BTD, d_model: int, layer: str):
  """Raises ValueError unless x is a floating [B,T,D] array with D = d_model."""
  if x_BTD.ndim != 3 or x_BTD.shape[-1] != d_model:
    raise ValueError(f"{layer}: expected input [B,T,D] with D={d_model}, got shape {x_BTD.shape}")
  if not jnp.issubdtype(x_BTD.dtype, jnp.floating):
    raise ValueError(f"{layer}: expected a floating input, got dtype {x_BTD.dtype}")


def logical_param(module: nn.Module, name: str, init_fn, shape: Sequence[int], axes: Axes,
                  dtype=jnp.float32):
  """Declares a parameter annotated with logical axis names (one per dimension)."""
  if len(axes) != len(shape):
    raise ValueError(f"param {name!r}: {len(axes)} logical axes {axes} for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init_fn, axes), tuple(shape), dtype)


class Dense(nn.Module):
  """y = x @ W over the last axis of x, W of shape [in, *features] with logical `axes`."""

  features: int | tuple[int, ...]
  axes: Axes
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: object = None  # default: fan-in over the single input axis

  @nn.compact
  def __call__(self, x):
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    init = self.kernel_init or kernel_init(1, 1 + len(features))
    w = logical_param(self, "kernel", init, (x.shape[-1], *features), self.axes, self.param_dtype)
    if not self.use_bias:
      return dense_apply(w, x, self.dtype)
    y = dense_apply(w, x, self.dtype, out_dtype=jnp.float32)
    b = logical_param(self, "bias", nn.initializers.zeros, features, self.axes[1:], self.param_dtype)
    return (y + b).astype(self.dtype)


def dense_apply(w, x, dtype, out_dtype=None):
  """x @ w over x's last axis, w [in, *features]: `matmul` (operands in `dtype`, float32 accumulation,
  backward in `dtype`), the result in out_dtype (default dtype). Dense's math, for code that holds the
  kernel itself."""
  y = matmul("md,df->mf", x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1), dtype, out_dtype)
  return y.reshape(*x.shape[:-1], *w.shape[1:])


def rms_norm(x, scale=None, eps: float = 1e-6):
  """RMSNorm in float32 over the last axis; returns float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if scale is None else y * scale.astype(jnp.float32)


class RMSNorm(nn.Module):
  """RMSNorm with a learned per-channel scale (initialised to one)."""

  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  axis_name: str | None = "norm"

  @nn.compact
  def __call__(self, x):
    scale = logical_param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,),
                          self.param_dtype)
    return rms_norm(x, scale, self.eps).astype(self.dtype)


def remat_pieces(fn, pieces: int, *xs_M) -> list:
  """[fn(*piece_i) for the `pieces` equal consecutive slices of the xs' leading axis], each piece
  rematerialised in the backward pass, so that one piece's activations are live at a time.

  A Python loop, not lax.map: a scan's stacked outputs, and in its backward pass the accumulators of
  its cotangents, start as zero-filled buffers, and XLA:GPU merged those of every layer into one kernel
  early in the step, which kept them all live at once (43 GiB of the T=1M step's peak on the H200).
  """
  m = xs_M[0].shape[0]
  if any(x.shape[0] != m for x in xs_M) or m % pieces:
    raise ValueError(f"{pieces} pieces need leading axes that they divide, got {[x.shape for x in xs_M]}")
  size, one = m // pieces, jax.checkpoint(fn)
  return [one(*(jax.lax.slice_in_dim(x, i * size, (i + 1) * size) for x in xs_M)) for i in range(pieces)]


# The collection of gradient accumulators (train_step.accumulated): for a parameter whose module adds
# its accumulator to its gradient, an array of its shape and dtype at the parameter's path. Such a
# module sows a marker into GRAD_ACC_TAKEN, so that the caller can tell that none went unread (Flax
# ignores collections that nothing reads, and an unread accumulator would be lost).
GRAD_ACC = "grad_acc"
GRAD_ACC_TAKEN = "grad_acc_taken"


def add_to_gradient(w, acc):
  """w, whose cotangent comes back as acc + its own: gradient accumulation over passes for a weight
  used anywhere, any number of times. acc must have w's shape and dtype; its cotangent is zero."""
  if acc.shape != w.shape or acc.dtype != w.dtype:
    raise ValueError(f"a gradient accumulator must have its weight's shape and dtype "
                     f"{w.dtype}{list(w.shape)}, got {acc.dtype}{list(acc.shape)}")
  return _add_to_gradient(w, acc)


@jax.custom_vjp
def _add_to_gradient(w, acc):
  return w


def _add_to_gradient_fwd(w, acc):
  return w, acc


def _add_to_gradient_bwd(acc, dw):
  return acc + dw, None


_add_to_gradient.defvjp(_add_to_gradient_fwd, _add_to_gradient_bwd)
