"""SiTU-GLU: the bounded gated activation, and the dense FFN built on it (DESIGN §5)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.nn import Dense


def situ_glu(gate, up, b1: float = 4.0, b2: float = 25.0):
  """h = [b1 tanh(G/b1) sigmoid(G)] * [b2 tanh(U/b2)], so |h| <= b1*b2.

  Near zero tanh(x/b) ~ x/b, so h ~ G sigmoid(G) * U: SwiGLU. Computed in float32.
  """
  g32 = gate.astype(jnp.float32)
  u32 = up.astype(jnp.float32)
  h = (b1 * jnp.tanh(g32 / b1) * jax.nn.sigmoid(g32)) * (b2 * jnp.tanh(u32 / b2))
  return h.astype(gate.dtype)


class SiTUGLU(nn.Module):
  """Dense FFN: W_d situ_glu(W_g x, W_u x)."""

  hidden_dim: int
  b1: float = 4.0
  b2: float = 25.0
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, segment_ids_BT=None):
    del segment_ids_BT  # position-wise: documents cannot mix here
    dense = lambda f, axes, name: Dense(f, axes, dtype=self.dtype, param_dtype=self.param_dtype,
                                        name=name)
    gate_BTF = dense(self.hidden_dim, ("embed", "mlp"), "gate")(x_BTD)
    up_BTF = dense(self.hidden_dim, ("embed", "mlp"), "up")(x_BTD)
    h_BTF = situ_glu(gate_BTF, up_BTF, self.b1, self.b2)
    return dense(x_BTD.shape[-1], ("mlp", "embed"), "down")(h_BTF)
