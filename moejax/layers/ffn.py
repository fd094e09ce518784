"""SiTU-GLU: the bounded gated activation, and the dense FFN built on it (docs/design.md §5)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.nn import Dense, dense_apply, remat_pieces


def _one_minus(p, z):
  """1 - p for p = exp(-z), z >= 0, float32, to a relative error of about 1e-6: below z = 0.1 from the
  series of 1 - exp(-z), where the subtraction would cancel (1e-4 relative error at z = 1e-3). jnp.expm1
  is accurate too but took the H200 longer than the tanh it replaces (BENCHMARKS.md, "SiTU-GLU
  element-wise pass")."""
  series = z * (1.0 - z * (1.0 / 2 - z * (1.0 / 6 - z * (1.0 / 24 - z * (1.0 / 120)))))
  return jnp.where(z < 0.1, series, 1.0 - p)


def _situ_product(g32, u32, b1: float, b2: float):
  """h = b1 tanh(g/b1) sigmoid(g) b2 tanh(u/b2), float32, from exponentials of -|x| and one division.

  With p = exp(-2|g|/b1), e = exp(-|g|), r = exp(-2|u|/b2), all in (0, 1]: tanh(|g|/b1) = (1-p)/(1+p),
  sigmoid(g) = 1/(1+e) for g >= 0 and e/(1+e) below, tanh(|u|/b2) = (1-r)/(1+r); the signs of g and u
  give h's, and no term can overflow. On the H200 this pass is faster than the same formula written with
  jnp.tanh and jax.nn.sigmoid (BENCHMARKS.md, "SiTU-GLU element-wise pass"). The backward pass keeps
  that form: its expressions must differ from these, or XLA merges the two (CSE) and keeps this pass's
  float32 values until the backward pass, 1.5 GiB per MoE layer of the H200 step.
  """
  ag, au = jnp.abs(g32), jnp.abs(u32)
  zg, zu = ag * (2.0 / b1), au * (2.0 / b2)
  p, r = jnp.exp(-zg), jnp.exp(-zu)
  e = p * p if b1 == 4.0 else jnp.exp(-ag)  # at the usual bound exp(-|g|) = p^2, one exponential fewer
  num = _one_minus(p, zg) * _one_minus(r, zu) * jnp.where(g32 >= 0, 1.0, e)
  magnitude = (b1 * b2) * num / ((1.0 + p) * (1.0 + e) * (1.0 + r))
  return jnp.where((g32 < 0) != (u32 < 0), -magnitude, magnitude)


def _situ_grads(g32, u32, dh32, b1: float, b2: float):
  """(dL/dgate, dL/dup) of h = A(g) B(u), float32, with A' = (1 - tanh^2(g/b1)) s + b1 tanh(g/b1) s (1-s)
  for s = sigmoid(g), and B' = 1 - tanh^2(u/b2)."""
  tg, s, tu = jnp.tanh(g32 / b1), jax.nn.sigmoid(g32), jnp.tanh(u32 / b2)
  dA = (1.0 - tg * tg) * s + b1 * tg * s * (1.0 - s)
  return dh32 * (b2 * tu) * dA, dh32 * (b1 * tg * s) * (1.0 - tu * tu)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def situ_glu(gate, up, b1: float = 4.0, b2: float = 25.0):
  """h = [b1 tanh(G/b1) sigmoid(G)] * [b2 tanh(U/b2)], so |h| <= b1*b2.

  Near zero tanh(x/b) ~ x/b, so h ~ G sigmoid(G) * U: SwiGLU. Computed in float32, returned in gate's
  dtype. The backward pass keeps only gate and up and recomputes the rest in one element-wise pass
  (autodiff kept float32 intermediates of the [tokens, hidden] activations).
  """
  return _situ_product(gate.astype(jnp.float32), up.astype(jnp.float32), b1, b2).astype(gate.dtype)


def _situ_glu_fwd(gate, up, b1, b2):
  return situ_glu(gate, up, b1, b2), (gate, up)


def _situ_glu_bwd(b1, b2, res, dh):
  gate, up = res
  dg, du = _situ_grads(gate.astype(jnp.float32), up.astype(jnp.float32), dh.astype(jnp.float32), b1, b2)
  return dg.astype(gate.dtype), du.astype(up.dtype)


situ_glu.defvjp(_situ_glu_fwd, _situ_glu_bwd)


class SiTUGLU(nn.Module):
  """Dense FFN: W_d situ_glu(W_g x, W_u x).

  token_chunk > 0: the tokens (B*T of them, which it must divide) go through in passes of that many,
  each rematerialised in the backward pass, so one pass's [token_chunk, hidden_dim] activations are
  live at a time instead of the whole row's; the result is the same function.
  """

  hidden_dim: int
  b1: float = 4.0
  b2: float = 25.0
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  token_chunk: int = 0

  @nn.compact
  def __call__(self, x_BTD, packing=None):
    del packing  # position-wise: documents cannot mix here
    tokens = math.prod(x_BTD.shape[:-1])
    chunk = self.token_chunk
    if not chunk or tokens <= chunk or self.is_initializing():
      dense = lambda f, axes, name: Dense(f, axes, dtype=self.dtype, param_dtype=self.param_dtype,
                                          name=name)
      gate_BTF = dense(self.hidden_dim, ("embed", "mlp"), "gate")(x_BTD)
      up_BTF = dense(self.hidden_dim, ("embed", "mlp"), "up")(x_BTD)
      h_BTF = situ_glu(gate_BTF, up_BTF, self.b1, self.b2)
      return dense(x_BTD.shape[-1], ("mlp", "embed"), "down")(h_BTF)
    if tokens % chunk:
      raise ValueError(f"ffn token_chunk={chunk} does not divide the {tokens} tokens of x {x_BTD.shape}")
    # The same params the unchunked path creates (gate/up/down "kernel"), used directly.
    w = {name: nn.meta.unbox(self.variables["params"][name]["kernel"]) for name in ("gate", "up", "down")}

    def one(x_CD):
      h_CF = situ_glu(dense_apply(w["gate"], x_CD, self.dtype), dense_apply(w["up"], x_CD, self.dtype),
                      self.b1, self.b2)
      return dense_apply(w["down"], h_CF, self.dtype)

    y_MD = jnp.concatenate(remat_pieces(one, tokens // chunk, x_BTD.reshape(tokens, x_BTD.shape[-1])))
    return y_MD.reshape(x_BTD.shape[:-1] + y_MD.shape[-1:])
