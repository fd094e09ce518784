"""The grouped SiTU-GLU expert MLP with its element-wise work fused into the grouped matmuls (DESIGN §5).

    y[r] = W_d[g] h_r,   h_r = situ(W_g[g]^T x_r, W_u[g]^T x_r),   situ(G, U) = A(G) B(U),
    A(G) = b1 tanh(G/b1) sigmoid(G),   B(U) = b2 tanh(U/b2)

Unfused, SiTU-GLU is its own pass in each direction: forward it reads gate and up and writes h, backward
it reads gate, up and dh and writes dgate and dup (on the H200 step, 10.2 and 10.8 ms over 15 layers:
about half as long again as the gate and up matmuls). Here
  forward:  one kernel computes gate and up (two accumulators on one x tile) and writes gate, up and h;
            then y = gmm(h, W_d);
  backward: one kernel computes dh = dy W_d^T and, in its epilogue, dgate and dup from the gate and up
            tiles (dh is never written); dx = dgate W_g^T + dup W_u^T is one kernel (two products
            summed in one accumulator); the three weight gradients are the plain drhs kernel.
The element-wise math is `situ_factors` / `situ_grads`, shared with the unfused path (moejax.layers.ffn).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gmm.kernel import Fusion, gmm_fused_pallas, gmm_pallas, tgmm_pallas
from pallas_kernels.gmm.tiling import Tile, Tiling, resolve_tiling


def situ_factors(g32, u32, b1: float, b2: float):
  """The two factors of SiTU-GLU, float32: (b1 tanh(g/b1) sigmoid(g), b2 tanh(u/b2))."""
  return b1 * jnp.tanh(g32 / b1) * jax.nn.sigmoid(g32), b2 * jnp.tanh(u32 / b2)


def situ_grads(g32, u32, dh32, b1: float, b2: float):
  """(dL/dgate, dL/dup) of h = A(g) B(u), float32, with A' = (1 - tanh^2(g/b1)) s + b1 tanh(g/b1) s (1-s)
  for s = sigmoid(g), and B' = 1 - tanh^2(u/b2)."""
  tg, s, tu = jnp.tanh(g32 / b1), jax.nn.sigmoid(g32), jnp.tanh(u32 / b2)
  dA = (1.0 - tg * tg) * s + b1 * tg * s * (1.0 - s)
  return dh32 * (b2 * tu) * dA, dh32 * (b1 * tg * s) * (1.0 - tu * tu)


@dataclasses.dataclass(frozen=True)
class _Forward:
  """Epilogue of the gate/up kernel: (gate, up, h) from the two accumulators. h is computed from the
  float32 accumulators; the backward pass sees gate and up as stored."""
  b1: float
  b2: float

  def __call__(self, gate32, up32):
    a, b = situ_factors(gate32, up32, self.b1, self.b2)
    return gate32, up32, a * b


@dataclasses.dataclass(frozen=True)
class _Backward:
  """Epilogue of the dh kernel: (dgate, dup) from the dh accumulator and the stored gate and up tiles."""
  b1: float
  b2: float

  def __call__(self, dh32, gate, up):
    return situ_grads(gate.astype(jnp.float32), up.astype(jnp.float32), dh32, self.b1, self.b2)


@dataclasses.dataclass(frozen=True)
class GLUTiling:
  """Tiles of the fused kernels: gate/up (two accumulators), dh with the SiTU-GLU backward epilogue, and
  dx (two products per step). The down projection and the weight gradients use `plain`.

  Chosen, not swept: 128 x 128 output tiles, so that two float32 accumulators (or one and the epilogue's
  gate and up tiles) fit the registers of 8 warps; 3 stages of the two-operand loads fit shared memory.
  """
  gate_up: Tile = Tile(bm=128, bk=64, bn=128, num_warps=8, num_stages=3)
  dh: Tile = Tile(bm=128, bk=64, bn=128, num_warps=8, num_stages=3)
  dx: Tile = Tile(bm=128, bk=64, bn=128, num_warps=8, num_stages=3)
  plain: Tiling = Tiling()

  @classmethod
  def of(cls, tile: Tile) -> "GLUTiling":
    """One tile for every kernel (tests)."""
    return cls(tile, tile, tile, resolve_tiling(tile))


def grouped_situ_glu_fused(x_RL, group_sizes_G, w_gate_GLF, w_up_GLF, w_down_GFL, b1: float, b2: float, *,
                           tiling: GLUTiling | None = None, interpret: bool = False):
  """y [R, L] in x's dtype: row r, in group g, gets W_d[g] situ(W_g[g]^T x_r, W_u[g]^T x_r).

  Rows are sorted by group (group g owns the next group_sizes[g] rows); rows past the groups come out
  as zeros, and so do their gradients. The weights must be in x's dtype; accumulation is float32.
  Differentiable in x and the three weights. Pallas (Triton) kernels; interpret=True runs them on CPU.
  """
  r, l_in = x_RL.shape
  g, f = w_gate_GLF.shape[0], w_gate_GLF.shape[2]
  want = {"w_gate": (g, l_in, f), "w_up": (g, l_in, f), "w_down": (g, f, l_in)}
  for name, w in zip(want, (w_gate_GLF, w_up_GLF, w_down_GFL), strict=True):
    if w.shape != want[name] or w.dtype != x_RL.dtype:
      raise ValueError(f"grouped SiTU-GLU: {name} must be {want[name]} in {x_RL.dtype} for x {x_RL.shape} "
                       f"and {g} groups, got {w.shape} in {w.dtype}")
  if group_sizes_G.shape != (g,) or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise ValueError(f"grouped SiTU-GLU: group_sizes must be [{g}] integer, got {group_sizes_G.shape} "
                     f"{group_sizes_G.dtype}")
  return _glu_jit(x_RL, group_sizes_G.astype(jnp.int32), w_gate_GLF, w_up_GLF, w_down_GFL, float(b1),
                  float(b2), tiling or GLUTiling(), bool(interpret))


def _forward(x, sizes, w_gate, w_up, w_down, b1, b2, tiling, interpret):
  dt = x.dtype
  gate, up, h = gmm_fused_pallas([x], [w_gate, w_up], [], sizes, fusion=_gate_up(b1, b2),
                                 out_dtypes=[dt, dt, dt], tile=tiling.gate_up, interpret=interpret,
                                 name="gmm_situ_glu")
  y = gmm_pallas(h, w_down, sizes, tile=tiling.plain.fwd, out_dtype=dt, interpret=interpret)
  return y, (x, sizes, w_gate, w_up, w_down, gate, up, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _glu(x, sizes, w_gate, w_up, w_down, b1, b2, tiling, interpret):
  return _forward(x, sizes, w_gate, w_up, w_down, b1, b2, tiling, interpret)[0]


def _glu_bwd(b1, b2, tiling, interpret, res, dy):
  x, sizes, w_gate, w_up, w_down, gate, up, h = res
  dt = x.dtype
  dy = dy.astype(dt)
  dgate, dup = gmm_fused_pallas([dy], [w_down], [gate, up], sizes, fusion=_dh(b1, b2), out_dtypes=[dt, dt],
                                tile=tiling.dh, transpose_rhs=True, interpret=interpret,
                                name="gmm_t_situ_glu_bwd")
  (dx,) = gmm_fused_pallas([dgate, dup], [w_gate, w_up], [], sizes, fusion=_DX, out_dtypes=[dt],
                           tile=tiling.dx, transpose_rhs=True, interpret=interpret, name="gmm_t_dual")
  drhs = functools.partial(tgmm_pallas, group_sizes_G=sizes, tile=tiling.plain.drhs, out_dtype=dt,
                           interpret=interpret)
  return dx, None, drhs(x, dgate), drhs(x, dup), drhs(h, dy)


def _gate_up(b1, b2):
  return Fusion(sums=(((0, 0),), ((0, 1),)), epilogue=_Forward(b1, b2))


def _dh(b1, b2):
  return Fusion(sums=(((0, 0),),), num_extras=2, epilogue=_Backward(b1, b2))


_DX = Fusion(sums=(((0, 0), (1, 1)),))
_glu.defvjp(_forward, _glu_bwd)
# One traced and lowered function for every MoE layer (as ops._gmm_jit).
_glu_jit = jax.jit(_glu, static_argnums=(5, 6, 7, 8))
