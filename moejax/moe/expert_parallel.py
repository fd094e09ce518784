"""Expert-parallel routed experts, run per device inside jax.shard_map over the `expert` axis.

Each device holds E/P consecutive experts (device d owns experts d*E/P ... (d+1)*E/P - 1) and a
shard of the tokens. It sorts its (token, slot) pairs by expert, which also groups them by owner,
sends each group to its owner by all-to-all, runs its local experts as one grouped matmul, and sends
the results back the same way. Two exchanges, chosen by platform (`default_exchange`):

* "ragged" (GPU/TPU): `jax.lax.ragged_all_to_all`. The receiver's buffer is laid out expert-major
  ((local expert, source) order), so the received rows are already grouped for ragged_dot. XLA:CPU
  cannot run this op (it lowers, but does not compile).
* "padded" (CPU): `jax.lax.all_to_all` of a [P, C, L] buffer, C rows per (source, owner) pair; the
  owner sorts what it received by local expert.

Each receiver keeps at most B = min(P * R, max(1, ceil(cf * R))) rows, R = tokens * k on a device,
so a (token, slot) pair can be dropped when one owner is overloaded. Both exchanges keep the same
pairs (docs/design.md §5: the two paths must agree): the first B of the owner's rows in (local expert,
source, position) order (`ragged_layout`, from every source's per-expert counts). The padded
buffer's pairs hold C = min(R, B) rows, all that one source can have kept; what a source sends is
already cut to the owner's budget. So the padded exchange moves P * C rows, up to P times the ragged
buffer (it runs on the CPU only), and its experts run on the B rows that can hold data. Dropped pairs
contribute zero and are counted: the count is returned and the MoE layer sows it. cf >= P makes both
paths dropless.
"""

import math

import jax
import jax.numpy as jnp

from moejax.moe.dispatch import (
    combine,
    gather_pairs,
    grouped_situ_glu,
    inverse_permutation,
    permute_rows,
    sort_by_expert,
)

EXCHANGES = ("padded", "ragged")


def default_exchange() -> str:
  """The ragged all-to-all where XLA implements it; the capacity-padded one on CPU."""
  return "padded" if jax.default_backend() == "cpu" else "ragged"


def _check(num_experts, parts, w_gate_ELF):
  if num_experts % parts:
    raise ValueError(f"num_experts={num_experts} is not divisible by the expert axis size {parts}")
  if w_gate_ELF.shape[0] != num_experts // parts:
    raise ValueError(f"expected {num_experts // parts} local experts per device, got weights of "
                     f"shape {w_gate_ELF.shape}")


def padded_expert_parallel(x_ML, idx_MK, p_MK, w_gate_ELF, w_up_ELF, w_down_EFL, *, num_experts: int,
                           capacity_factor: float, b1: float, b2: float, axis_name: str = "expert",
                           grouped_matmul: str = "auto"):
  """Routed-expert mixture [M, L] (float32) and dropped-pair count, via capacity-padded all_to_all;
  it keeps the pairs that `ragged_expert_parallel` keeps."""
  parts = jax.lax.axis_size(axis_name)
  _check(num_experts, parts, w_gate_ELF)
  m, k = idx_MK.shape
  e_loc, rows = num_experts // parts, m * k
  buffer_rows = receiver_rows(capacity_factor, rows, parts)
  cap = min(rows, buffer_rows)
  order_R, inverse_R, sizes_E = sort_by_expert(idx_MK, num_experts)
  x_RL = gather_pairs(x_ML, order_R, inverse_R, k)
  expert_R = idx_MK.reshape(-1)[order_R]
  owner_R = expert_R // e_loc
  # The rows of each expert that its owner keeps: the first send_E[e] of this source's (sorted) group.
  _, sent_DES = ragged_layout(jax.lax.all_gather(sizes_E, axis_name), parts, buffer_rows)
  send_E = sent_DES[:, :, jax.lax.axis_index(axis_name)].reshape(num_experts)
  row_R = jnp.arange(rows, dtype=jnp.int32)
  keep_R = row_R - (jnp.cumsum(sizes_E) - sizes_E)[expert_R] < send_E[expert_R]
  send_P = send_E.reshape(parts, e_loc).sum(axis=1)
  pos_R = jnp.cumsum(keep_R, dtype=jnp.int32) - 1 - (jnp.cumsum(send_P) - send_P)[owner_R]
  slot_R = jnp.where(keep_R, owner_R * cap + pos_R, parts * cap)  # out of range: dropped by the scatter

  send_XL = jnp.zeros((parts * cap, x_RL.shape[1]), x_RL.dtype).at[slot_R].set(x_RL, mode="drop")
  send_X = jnp.full((parts * cap,), e_loc, jnp.int32).at[slot_R].set(expert_R % e_loc, mode="drop")
  swap = lambda a: jax.lax.all_to_all(a.reshape(parts, cap, *a.shape[1:]), axis_name, 0, 0,
                                      tiled=True).reshape(a.shape)
  recv_XL, recv_X = swap(send_XL), swap(send_X)

  # Empty slots carry the id e_loc: they sort last, past the group sizes, where ragged_dot gives 0.
  local_order = jnp.argsort(recv_X, stable=True).astype(jnp.int32)
  local_sizes = jnp.zeros((e_loc + 1,), jnp.int32).at[recv_X].add(1)[:e_loc]
  local_inverse = inverse_permutation(local_order)
  # At most buffer_rows rows reach an owner and the empty slots sort last: the experts run on those.
  sorted_XL = permute_rows(recv_XL, local_order, local_inverse)[:buffer_rows]
  y_sorted = grouped_situ_glu(sorted_XL, local_sizes, w_gate_ELF, w_up_ELF, w_down_EFL, b1, b2,
                              grouped_matmul)
  y_sorted = jnp.pad(y_sorted, ((0, parts * cap - buffer_rows), (0, 0)))
  y_XL = swap(permute_rows(y_sorted, local_inverse, local_order).astype(x_RL.dtype))
  y_RL = jnp.where(keep_R[:, None], y_XL[jnp.minimum(slot_R, parts * cap - 1)], 0)
  return combine(y_RL, order_R, inverse_R, p_MK), jnp.sum(~keep_R).astype(jnp.int32)


def receiver_rows(capacity_factor: float, rows: int, parts: int) -> int:
  """Rows one owner keeps of what all sources send it: ceil(cf * rows), at least 1, at most all."""
  return min(parts * rows, max(1, math.ceil(capacity_factor * rows)))


def ragged_layout(counts_SE, parts: int, buffer_rows: int):
  """Receiver-side layout of the ragged exchange, from every source's per-expert counts [P, E].

  Returns offsets and sizes indexed [owner d, local expert e, source s]: the rows of source s for
  expert d*E/P + e land at offset[d, e, s] of d's buffer (expert-major, then source), and only the
  first sent[d, e, s] of them fit into `buffer_rows`.
  """
  e_loc = counts_SE.shape[1] // parts
  cnt_DES = counts_SE.reshape(parts, parts, e_loc).transpose(1, 2, 0)
  flat = cnt_DES.reshape(parts, e_loc * parts)
  off_DES = (jnp.cumsum(flat, axis=1) - flat).reshape(parts, e_loc, parts)
  sent_DES = jnp.clip(buffer_rows - off_DES, 0, cnt_DES)
  return off_DES, sent_DES


def ragged_expert_parallel(x_ML, idx_MK, p_MK, w_gate_ELF, w_up_ELF, w_down_EFL, *, num_experts: int,
                           capacity_factor: float, b1: float, b2: float, axis_name: str = "expert",
                           exchange=jax.lax.ragged_all_to_all, grouped_matmul: str = "auto"):
  """Like `padded_expert_parallel`, with ragged all-to-alls (GPU/TPU). `exchange` has the signature
  of jax.lax.ragged_all_to_all (tests substitute an emulation built from all_gather on CPU)."""
  parts = jax.lax.axis_size(axis_name)
  _check(num_experts, parts, w_gate_ELF)
  m, k = idx_MK.shape
  e_loc, rows = num_experts // parts, m * k
  buffer_rows = receiver_rows(capacity_factor, rows, parts)
  me = jax.lax.axis_index(axis_name)
  order_R, inverse_R, sizes_E = sort_by_expert(idx_MK, num_experts)
  x_RL = gather_pairs(x_ML, order_R, inverse_R, k)
  counts_SE = jax.lax.all_gather(sizes_E, axis_name)
  off_DES, sent_DES = ragged_layout(counts_SE, parts, buffer_rows)
  start_SE = jnp.cumsum(counts_SE, axis=1) - counts_SE  # where each expert's rows start at the source

  # Out: one slice per global expert (slice g goes to device g // e_loc, its owner).
  send_E = sent_DES[:, :, me].reshape(num_experts)
  recv_XL = exchange(x_RL, jnp.zeros((buffer_rows, x_RL.shape[1]), x_RL.dtype), start_SE[me], send_E,
                     off_DES[:, :, me].reshape(num_experts), sent_DES[me].T.reshape(num_experts),
                     axis_name=axis_name)
  y_XL = grouped_situ_glu(recv_XL, sent_DES[me].sum(axis=1), w_gate_ELF, w_up_ELF, w_down_EFL, b1, b2,
                          grouped_matmul)

  # Back: slice s*e_loc + e returns source s's rows for local expert e to where they came from.
  start_back = jax.lax.dynamic_slice_in_dim(start_SE, me * e_loc, e_loc, axis=1)
  y_RL = exchange(y_XL.astype(x_RL.dtype), jnp.zeros_like(x_RL), off_DES[me].T.reshape(num_experts),
                  sent_DES[me].T.reshape(num_experts), start_back.reshape(num_experts), send_E,
                  axis_name=axis_name)
  return combine(y_RL, order_R, inverse_R, p_MK), jnp.sum(sizes_E - send_E).astype(jnp.int32)


def expert_parallel(x_ML, idx_MK, p_MK, w_gate_ELF, w_up_ELF, w_down_EFL, *, exchange: str, **kwargs):
  """Dispatches to the named exchange ("padded" or "ragged")."""
  if exchange == "padded":
    return padded_expert_parallel(x_ML, idx_MK, p_MK, w_gate_ELF, w_up_ELF, w_down_EFL, **kwargs)
  if exchange == "ragged":
    return ragged_expert_parallel(x_ML, idx_MK, p_MK, w_gate_ELF, w_up_ELF, w_down_EFL, **kwargs)
  raise ValueError(f"expert-parallel exchange {exchange!r} not in {EXCHANGES}")
