"""KDA's forward state pass in P segments walked at once (the forward alone: no states kept): the
segments' arithmetic, around scan_forward.scan_kernel, which scan_forward.scan_forward_mosaic calls with
segments > 1.

The pass is sequential over chunks, one program per (V block, head, batch row): at B=1 H=16 V=128 that is
64 programs for the H200's 132 SMs, walking every chunk of the row one after another. The state pass is
affine in the state it starts from. Per chunk c of a segment entered with state S,
  S_c = A_c S_{c-1} + B_c,   o_c = F_c S_{c-1} + G_c,
so a segment's outputs and final state are those of the segment walked from zero (its local pass) plus
linear maps of S: o = o_local + o_hom S and S_end = S_local + Phi S. o_hom and Phi are what the same pass
gives walked from the identity with U = 0 (its homogeneous pass: V' = -W S, the K columns of the
identity as K more value columns).

So the kernel (scan_forward.scan_kernel with segments, from `initial_states`) walks all P segments at
once: segment 0 from the caller's state, segments 1..P-1 from zero plus their homogeneous passes,
P (V + K) / BV programs per head and row instead of V / BV (less segment 0's K / BV, which have nothing
to do), each over about N / P chunks (segment_length; the last segment takes the rest). Then (`join`)
the segments' entering states one after another (P - 1 small [K,K] x [K,V] products per head, in XLA),
and a Triton kernel (`add_entering`) adds o_hom S to the outputs of segments 1..P-1 in place. (In XLA,
that update of the kernel's output, a dynamic-update-slice, made XLA 0.11.2's GPU compiler fuse it with
the Mosaic call and then fail on a cycle; a concatenate would rewrite the whole output.)

Document starts need nothing more: the prep kernel's operands already carry them (a start zeroes what
enters from before it), and they are operands of both passes alike.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda.mosaic.common import ROWS


def segment_length(N: int, P: int, C: int) -> int | None:
  """Chunks in each of segments 0..P-2 when a row of N chunks of C rows is walked in P segments; the last
  segment takes the other N - (P - 1) Ns, from 1 to Ns. Ns is N / P rounded up, and further up to whole
  64-row blocks (the rows of a program of add_entering) where the last segment keeps a chunk. None where
  no Ns leaves the last segment a chunk (N = 4, P = 3): pad the row to segmented_chunks."""
  Ns = -(-N // P)
  per_block = max(1, ROWS // C)
  rounded = -(-Ns // per_block) * per_block
  if (P - 1) * rounded < N:
    return rounded
  return Ns if (P - 1) * Ns < N else None


def segmented_chunks(N: int, P: int, C: int) -> int:
  """The fewest chunks, at least N, that a row can be walked in P segments over (segment_length)."""
  return N if segment_length(N, P, C) is not None else P * -(-N // P)


def initial_states(S0, segments: int, *, B: int, H: int, K: int, V: int):
  """The kernel's S0 [B*P,H,K,V+K] for a walk in P = `segments` segments from the caller's S0 [B,H,K,V]:
  row b*P + p enters segment p of row b, from the caller's state for p = 0, else zero; its last K columns
  start the homogeneous pass from the identity (segment 0 runs none)."""
  P = segments
  if not isinstance(P, int) or P < 2:
    raise ValueError(f"segments must be an int >= 2 here, got {P!r}")
  S0_local = jnp.zeros((B, P, H, K, V), jnp.float32).at[:, 0].set(S0.astype(jnp.float32))
  eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, P, H, K, K))
  return jnp.concatenate([S0_local, eye], axis=-1).reshape(B * P, H, K, V + K)


def join(o, o_hom, S_ext, segments: int, *, interpret: bool):
  """(o [B,T,H,V], S_fin [B,H,K,V] float32) from what the kernel returns for a walk in P = `segments`
  segments: the local passes' o, the homogeneous passes' o_hom [B,T-Ns*C,H,K] and the final states S_ext
  [B*P,H,K,V+K] (module docstring)."""
  B, _, H, V = o.shape
  K = o_hom.shape[-1]
  P = segments
  S_ext = S_ext.reshape(B, P, H, K, V + K)
  S_local, Phi = S_ext[..., :V], S_ext[..., V:]
  # The state entering segments 1..P-1: segment p leaves S_local[p] + Phi[p] (what entered it).
  entering, S = [], S_local[:, 0]
  for p in range(1, P):
    entering.append(S)
    S = S_local[:, p] + jnp.einsum("bhkj,bhjv->bhkv", Phi[:, p], S, precision=jax.lax.Precision.HIGHEST)
  S_in = jnp.stack(entering, axis=1)  # [B, P-1, H, K, V]
  return add_entering(o, o_hom, S_in, interpret=interpret), S


def add_entering(o, o_hom, S_in, *, interpret: bool):
  """o [B,T,H,V] with o_hom [B,T-Ts,H,K] @ S_in [B,P-1,H,K,V] added to the rows of segments 1..P-1 over
  o's buffer, segment p being rows [p Ts, (p + 1) Ts) (the last one ends at T): the product from bf16
  operands, as the state pass's own products take them, the sum in float32. One program per (row block,
  V block, head, batch row). bf16 operands measured faster than float32 ones on the H200."""
  B, T, H, V = o.shape
  K = o_hom.shape[-1]
  Ts = T - o_hom.shape[1]
  # Rows per program: a power of two dividing every segment, so that each block has one entering state.
  BT = min(64, Ts & -Ts, (T - Ts) & -(T - Ts))
  BV = min(V & -V, 128 if K <= 128 else 64)  # the [K, BV] state block stays in registers
  if BT < 16 or V % BV:
    raise ValueError(f"segments of {Ts} rows in {T} and V = {V} do not tile into the correction's blocks")

  def kernel(o_ref, hom_ref, S_ref, out_ref):
    t, j, h, b = (pl.program_id(i) for i in range(4))
    rows, cols = pl.ds(t * BT, BT), pl.ds(j * BV, BV)
    S_KV = S_ref[b, (t * BT) // Ts, h, :, cols]
    fix = jax.lax.dot(hom_ref[b, rows, h, :].astype(jnp.bfloat16), S_KV.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)
    at = (b, pl.ds(Ts + t * BT, BT), h, cols)
    out_ref[at] = (o_ref[at].astype(jnp.float32) + fix).astype(out_ref.dtype)

  return pl.pallas_call(
      kernel, grid=((T - Ts) // BT, V // BV, H, B), out_shape=jax.ShapeDtypeStruct(o.shape, o.dtype),
      input_output_aliases={0: 0}, interpret=interpret, name="kda_segments_add_entering",
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(o, o_hom, S_in)
