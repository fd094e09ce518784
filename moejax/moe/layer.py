"""Stable LatentMoE (docs/design.md §5): shared full-width experts plus routed experts in a latent width.

    y = sum_s E_s(x) + W_up RMSNorm( sum_{i in topk(s + b)} p_i E_i(W_down x) )

Router: s = sigmoid(x W_r) in float32; top-k of s + b, where the bias b is routing state in the
"balance" collection (no gradient, see moejax/moe/balance.py); p = chosen s normalised over k, times
`routed_scaling` (which the RMSNorm then divides out, but for its eps). Experts are SiTU-GLUs; routed
ones are stacked [expert, ...] and run as one grouped matmul over tokens sorted by expert
(moejax/moe/dispatch.py).

Parallelism follows the ambient mesh (`jax.set_mesh`). When its token axes (data, fsdp, expert;
moejax/parallel/mesh.py) split the batch, the routed part runs per shard inside jax.shard_map: load
and aux-loss sums are psum'd, the quantile bias uses histograms summed over the token axes, and if the
`expert` axis has size > 1 the routed experts are split over it and tokens travel by all-to-all
(moejax/moe/expert_parallel.py); the output keeps the input's sharding. Without such a mesh everything
runs as plain (global-view) array code. The exchange is picked by platform (ragged_all_to_all on
GPU/TPU, capacity-padded all_to_all on CPU) unless `MoE(cfg, exchange=...)` names one.

Sown into the collection "router" (each a plain array, overwritten per call), when it is mutable:
  load       [n] float32   tokens routed to each expert in this batch (all shards);
  dropped    []  int32     (token, slot) pairs dropped by expert-parallel capacity (0 when local);
  bias_next  [n] float32   balance="quantile": the bias computed from this batch, for the next one;
  aux_loss   []  float32   balance="aux": the sequence-wise loss times aux_loss_weight (add it to the
                           training loss; it carries the router gradient).

Routing replay (moejax/moe/replay.py), on one token shard: where the collection "routing" is mutable
the layer sows "experts" [B, T, k], what each token took; given a "replay" collection it takes that
collection's "experts" instead (a token of -1s chooses its own), weighted by the router's scores.

Gradient accumulation: with float32 accumulators of the routed experts' weights in the collection
`moejax.nn.GRAD_ACC` (the names of EXPERT_WEIGHTS), each weight's gradient comes back as its
accumulator plus this pass's, and the layer sows a marker into `moejax.nn.GRAD_ACC_TAKEN`. Without a
shard_map and with one token chunk the grouped matmuls add it (`gmm`'s rhs_grad_acc: on GPU inside
the drhs kernel); otherwise it is added to the whole weight's cotangent (`moejax.nn.add_to_gradient`).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec as P

from moejax.layers.ffn import SiTUGLU
from moejax.layers.packing import document_ids_of
from moejax.moe.balance import quantile_bias
from moejax.moe.dispatch import dropless_moe
from moejax.moe.expert_parallel import default_exchange, expert_parallel
from moejax.moe.replay import EXPERTS, REPLAY, ROUTING
from moejax.moe.router import expert_load, router_scores, select_experts, sequence_aux_loss_terms
from moejax.nn import (
  GRAD_ACC,
  GRAD_ACC_TAKEN,
  add_to_gradient,
  default_kernel_init,
  logical_param,
  matmul,
  remat_pieces,
  rms_norm,
)
from moejax.parallel import mesh as meshlib

# Stacked expert weights [expert, in, out]: fan-in is `in` alone, not expert * in.
expert_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=(0,))

EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")


def _routed(w, x_BTD, doc_BT, bias_E, *, cfg, stats_wanted: bool, axes: tuple[str, ...],
            exchange: str | None, grad_accs=None, replay_BTK=None, record: bool = False):
  """Routed half of the layer on one shard of tokens (or all of them). Returns (y_BTD, stats).
  grad_accs: None, or the experts' gradient accumulators (outside any shard_map only). replay_BTK: the
  experts to take instead (routing replay, moejax/moe/replay.py); `record`: stats["experts"] [B, T, k]
  holds the experts taken (both on one shard only)."""
  e, dtype = cfg.moe, jnp.dtype(cfg.dtype)
  b, t, d = x_BTD.shape
  n, k = e.num_experts, e.top_k
  reduce = (lambda v: jax.lax.psum(v, axes)) if axes else (lambda v: v)
  x_MD = x_BTD.reshape(b * t, d)

  def solve_bias(start_E):
    with jax.named_scope("quantile_balance"):
      impl = None if e.balance_implementation == "auto" else e.balance_implementation
      return quantile_bias(s_ME, k, start_E, e.balance_iters, bins=e.histogram_bins if axes else None,
                           axis_name=axes or None, implementation=impl)

  # The named scopes label the layer's parts in profiles (tools/trace_parts.py).
  with jax.named_scope("router"):
    s_ME = router_scores(x_MD, w["router"], e.router_matmul)
    oracle = stats_wanted and e.balance == "quantile" and e.quantile_oracle
    if oracle:  # this batch's own bias, warm-started from the carried one (config.py: not causal)
      bias_E = solve_bias(bias_E)
    forced_MK = None if replay_BTK is None else replay_BTK.reshape(b * t, k)
    idx_MK, p_MK = select_experts(s_ME, bias_E, k, e.routed_scaling, forced_MK)
    stats = {"load": reduce(expert_load(idx_MK, n))}
    if record:
      stats["experts"] = idx_MK.reshape(b, t, k)

  with jax.named_scope("latent_down"):
    h_ML = matmul("md,dl->ml", x_MD, w["w_down"], dtype)
  experts = [w[name] for name in EXPERT_WEIGHTS]
  accs = None if grad_accs is None else tuple(grad_accs[name] for name in EXPERT_WEIGHTS)
  if accs is not None and e.token_chunk and b * t > e.token_chunk:
    # Several chunks use each weight: the accumulator joins the sum of their cotangents, once.
    experts, accs = [add_to_gradient(x, acc) for x, acc in zip(experts, accs, strict=True)], None

  def experts_fn(h_ML, idx_MK, p_MK):
    if exchange is None:
      y_ML = dropless_moe(h_ML, idx_MK, p_MK, *experts, cfg.ffn.situ_b1, cfg.ffn.situ_b2,
                          e.grouped_matmul, accs)
      return y_ML, jnp.zeros((), jnp.int32)
    return expert_parallel(
        h_ML, idx_MK, p_MK, *experts, exchange=exchange, num_experts=n,
        capacity_factor=e.capacity_factor, b1=cfg.ffn.situ_b1, b2=cfg.ffn.situ_b2,
        axis_name=meshlib.EXPERT_AXIS, grouped_matmul=e.grouped_matmul)

  y_ML, dropped = by_token_chunks(experts_fn, e.token_chunk, h_ML, idx_MK, p_MK)
  stats["dropped"] = reduce(dropped)
  with jax.named_scope("latent_up"):
    y_ML = rms_norm(y_ML, w["latent_norm"], cfg.norm_eps).astype(dtype)
    y_MD = matmul("ml,ld->md", y_ML, w["w_up"], dtype)

  if stats_wanted and e.balance == "quantile":
    stats["bias_next"] = bias_E if oracle else solve_bias(bias_E)
  if stats_wanted and e.balance == "aux":
    total, docs = sequence_aux_loss_terms(s_ME, idx_MK, doc_BT, k)
    stats["aux_loss"] = e.aux_loss_weight * reduce(total) / reduce(docs)
  return y_MD.reshape(b, t, d), stats


def by_token_chunks(fn, chunk: int, h_ML, idx_MK, p_MK):
  """fn(h, idx, p) -> (y [m, L], dropped []) over consecutive chunks of `chunk` tokens (0: all at
  once), each rematerialised in the backward pass, so only one chunk's routed rows (top_k per token,
  with their gate/up activations) are live at a time: what bounds the layer's memory at long T."""
  m = h_ML.shape[0]
  if not chunk or m <= chunk:
    return fn(h_ML, idx_MK, p_MK)
  if m % chunk:
    raise ValueError(f"moe.token_chunk={chunk} does not divide the {m} tokens of this shard")
  outs = remat_pieces(fn, m // chunk, h_ML, idx_MK, p_MK)
  return jnp.concatenate([y for y, _ in outs]), sum(d for _, d in outs)


class MoE(nn.Module):
  """Stable LatentMoE FFN. `exchange` forces the expert-parallel all-to-all ("padded" or "ragged");
  None picks it by platform (moejax.moe.expert_parallel.default_exchange)."""

  cfg: ml_collections.FrozenConfigDict
  exchange: str | None = None

  def _check_inputs(self, x_BTD):
    if x_BTD.ndim != 3 or x_BTD.shape[-1] != self.cfg.d_model:
      raise ValueError(f"MoE expects x [B, T, d_model={self.cfg.d_model}], got shape {x_BTD.shape}")
    if not jnp.issubdtype(x_BTD.dtype, jnp.floating):
      raise ValueError(f"MoE expects a float input, got {x_BTD.dtype}")

  def _weights(self):
    cfg, e = self.cfg, self.cfg.moe
    d, n, lat, f = cfg.d_model, e.num_experts, e.latent_dim, e.expert_hidden_dim
    pdtype = jnp.dtype(cfg.param_dtype)
    shapes = {
        "router": (default_kernel_init, (d, n), ("embed", "expert")),
        "w_down": (default_kernel_init, (d, lat), ("embed", "latent")),
        "expert_gate": (expert_kernel_init, (n, lat, f), ("expert", "latent", "mlp")),
        "expert_up": (expert_kernel_init, (n, lat, f), ("expert", "latent", "mlp")),
        "expert_down": (expert_kernel_init, (n, f, lat), ("expert", "mlp", "latent")),
        "latent_norm": (nn.initializers.ones, (lat,), ("norm",)),
        "w_up": (default_kernel_init, (lat, d), ("latent", "embed")),
    }
    # docs/design.md §5's router runs in float32: its weight stays float32 whatever param_dtype is, so that
    # small updates to it are not rounded away.
    return {name: logical_param(self, name, init, shape, axes, jnp.float32 if name == "router" else pdtype)
            for name, (init, shape, axes) in shapes.items()}

  @nn.compact
  def __call__(self, x_BTD, packing=None):
    """packing: a `moejax.layers.packing.Packing`, segment ids, or None (one document a row); the
    per-document aux loss (balance="aux") reads it."""
    self._check_inputs(x_BTD)
    doc_BT = document_ids_of(packing, *x_BTD.shape[:2])
    cfg, e = self.cfg, self.cfg.moe
    dtype = jnp.dtype(cfg.dtype)
    n = e.num_experts
    if not self.is_mutable_collection("balance") and not self.has_variable("balance", "bias"):
      raise ValueError("MoE needs its routing state: apply the model with variables "
                       "{'params': ..., 'balance': ...} as returned by init")
    # A skewed start (moe.initial_bias > 0 favours the first top_k experts) that balancing must undo.
    bias = self.variable("balance", "bias", lambda: jnp.where(jnp.arange(n) < e.top_k, e.initial_bias, 0.0)
                         .astype(jnp.float32))
    self.variable("balance", "load_total", jnp.zeros, (n,), jnp.float32)
    x_BTD = x_BTD.astype(dtype)

    shared = [SiTUGLU(e.shared_hidden_dim, cfg.ffn.situ_b1, cfg.ffn.situ_b2, dtype=dtype,
                      param_dtype=jnp.dtype(cfg.param_dtype), token_chunk=cfg.ffn.token_chunk,
                      name=f"shared_{i}")(x_BTD) for i in range(e.num_shared)]

    w = self._weights()
    grad_accs = self._grad_accumulators(w)
    if grad_accs is not None:
      self.sow(GRAD_ACC_TAKEN, "experts", jnp.zeros((), jnp.int32))
    if doc_BT is None:
      doc_BT = jnp.zeros(x_BTD.shape[:2], jnp.int32)
    mesh = jax.sharding.get_abstract_mesh()
    axes = meshlib.token_axes(mesh) if meshlib.token_shards(mesh) > 1 else ()
    ep = meshlib.axis_size(mesh, meshlib.EXPERT_AXIS) > 1
    exchange = (self.exchange or default_exchange()) if ep else None
    if grad_accs is not None and axes:
      # Outside the shard_map, where a weight's cotangent is already summed over the shards that
      # replicate it: inside, each shard would add the accumulator once.
      w = {**w, **{name: add_to_gradient(w[name], acc) for name, acc in grad_accs.items()}}
      grad_accs = None
    replay_BTK = self.get_variable(REPLAY, EXPERTS) if self.has_variable(REPLAY, EXPERTS) else None
    record = self.is_mutable_collection(ROUTING)
    if (replay_BTK is not None or record) and axes:
      raise ValueError("routing replay (recording or replaying the experts) needs the tokens on one shard: "
                       f"this mesh splits them over {axes}")
    if replay_BTK is not None and tuple(replay_BTK.shape) != (*x_BTD.shape[:2], e.top_k):
      raise ValueError(f"replayed experts {tuple(replay_BTK.shape)} do not match the tokens "
                       f"{tuple(x_BTD.shape[:2])} and top_k={e.top_k}")
    fn = functools.partial(_routed, cfg=cfg, stats_wanted=self.is_mutable_collection("router"),
                           axes=axes, exchange=exchange, grad_accs=grad_accs, replay_BTK=replay_BTK,
                           record=record)
    if axes:
      fn = self._shard_mapped(fn, w, x_BTD, axes, ep, meshlib.token_shards(mesh))
    routed_BTD, stats = fn(w, x_BTD, doc_BT, bias.value)
    if record:
      self.sow(ROUTING, EXPERTS, stats.pop("experts"), init_fn=lambda: None, reduce_fn=lambda _, new: new)
    for name, value in stats.items():
      self.sow("router", name, value, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    if not shared:
      return routed_BTD
    # Several shared experts are summed in float32 and rounded once. The routed part joins in the compute
    # dtype, so that on the GPU the add is W_up's matmul epilogue (cuBLAS adds it in float32 before the
    # output's one rounding) rather than a float32 matmul output, a float32 copy of the shared part and
    # a cast: 673 against 161 MiB of traffic per layer of the H200 step, counted statically.
    shared_BTD = shared[0] if len(shared) == 1 else sum(y.astype(jnp.float32) for y in shared).astype(dtype)
    return shared_BTD + routed_BTD

  def _grad_accumulators(self, w):
    """{expert weight name: its gradient accumulator} from the GRAD_ACC collection, or None."""
    given = self.variables.get(GRAD_ACC, {})
    if not given:
      return None
    if set(given) != set(EXPERT_WEIGHTS):
      raise ValueError(f"MoE takes gradient accumulators for exactly {EXPERT_WEIGHTS}, got {sorted(given)}")
    for name in EXPERT_WEIGHTS:
      acc, weight = given[name], w[name]
      if acc.shape != weight.shape or acc.dtype != weight.dtype or acc.dtype != jnp.float32:
        raise ValueError(f"the gradient accumulator of {name} must be float32 like its weight "
                         f"{weight.dtype}{list(weight.shape)}, got {acc.dtype}{list(acc.shape)}")
    return dict(given)

  def _shard_mapped(self, fn, w, x_BTD, axes, ep, shards):
    """Wraps fn in shard_map over the ambient mesh, with its inputs moved to the matching specs."""
    if x_BTD.shape[0] % shards:
      raise ValueError(f"batch size {x_BTD.shape[0]} is not divisible by the {shards} token shards "
                       f"of mesh axes {axes}")
    experts = meshlib.axis_size(jax.sharding.get_abstract_mesh(), meshlib.EXPERT_AXIS)
    if ep and self.cfg.moe.num_experts % experts:
      raise ValueError(f"moe.num_experts={self.cfg.moe.num_experts} is not divisible by the expert "
                       f"mesh axis size {experts}")
    w_specs = {name: P(meshlib.EXPERT_AXIS) if ep and name in EXPERT_WEIGHTS else P() for name in w}
    in_specs = (w_specs, P(axes), P(axes), P())
    out_specs = (P(axes), P())
    mapped = jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs)

    def call(w, x_BTD, doc_BT, bias_E):
      args = jax.tree.map(lambda spec, a: meshlib.constrain(a, spec), in_specs,
                          (w, x_BTD, doc_BT, bias_E), is_leaf=lambda s: isinstance(s, P))
      y_BTD, stats = mapped(*args)
      if meshlib.is_explicit(jax.sharding.get_abstract_mesh()):
        # Leave the output as the input came: the residual stream it joins has that sharding.
        y_BTD = jax.reshard(y_BTD, jax.typeof(x_BTD).sharding.spec)
      return y_BTD, stats

    return call
