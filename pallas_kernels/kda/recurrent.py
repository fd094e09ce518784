"""KDA as a token-by-token lax.scan: the slow, obviously-correct reference (docs/design.md §2).

Per head:  S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,  o_t = scale * S_t^T q_t.
Written as S' = Diag(exp(g_t)) S;  S_t = S' + b_t k_t (v_t - S'^T k_t)^T, which is the same product.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.inputs import check_inputs, resets, resolve_scale

# Reference numerics: no TF32 on GPU.
_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("output_final_state",))
def _recurrent(q, k, v, g, beta, scale, initial_state, reset_BT, output_final_state):
  B, T, H, K = q.shape
  V = v.shape[-1]
  f32 = lambda x: jnp.swapaxes(x.astype(jnp.float32), 0, 1)  # time first for the scan
  xs = (f32(q), f32(k), f32(v), f32(g), f32(beta), None if reset_BT is None else reset_BT.T)
  S0_BHKV = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))

  def step(S_BHKV, x):
    q_BHK, k_BHK, v_BHV, g_BHK, b_BH, reset_B = x
    # A new document forgets everything before it; the gate alone could not express that.
    if reset_B is not None:
      S_BHKV = jnp.where(reset_B[:, None, None, None], 0.0, S_BHKV)
    S_BHKV = S_BHKV * jnp.exp(g_BHK)[..., None]
    pred_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV, precision=_HI)
    S_BHKV = S_BHKV + jnp.einsum("bhk,bhv->bhkv", b_BH[..., None] * k_BHK, v_BHV - pred_BHV, precision=_HI)
    o_BHV = jnp.einsum("bhk,bhkv->bhv", q_BHK, S_BHKV, precision=_HI)
    return S_BHKV, o_BHV

  S_BHKV, o_TBHV = jax.lax.scan(step, S0_BHKV, xs)
  o_BTHV = (scale * jnp.swapaxes(o_TBHV, 0, 1)).astype(v.dtype)
  return o_BTHV, (S_BHKV if output_final_state else None)


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  segment_ids=None):
  """Token-by-token KDA. Same contract as `chunk_kda` (see pallas_kernels/kda/ops.py).

  Returns (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] float32 or None).
  """
  K = check_inputs(q, k, v, g, beta, initial_state, segment_ids).K
  scale = jnp.asarray(resolve_scale(scale, K), jnp.float32)
  return _recurrent(q, k, v, g, beta, scale, initial_state, resets(segment_ids),
                    bool(output_final_state))
