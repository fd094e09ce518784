"""The train state and the one jitted step that advances it.

Everything a run carries lives in `TrainState`: step, params, optimizer state, the routing balance
state (router biases and load statistics, which get no gradient) and the rng. Checkpoints save this
pytree whole, so a resumed run continues bit-exactly.
"""

import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from moejax import balance as balance_lib
from moejax import metrics as metrics_lib
from moejax import optim as optim_lib
from moejax.config import passes_per_step
from moejax.layers.moe import EXPERT_WEIGHTS
from moejax.loss import cross_entropy
from moejax.model import Transformer, init_variables, per_layer, tied_head
from moejax.nn import GRAD_ACC, GRAD_ACC_TAKEN
from moejax.optim import dict_to_cfg, learning_rate_schedule, make_optimizer, qk_clip
from moejax.parallel import mesh as meshlib
from pallas_kernels.segments import document_ids


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  balance: Any  # the model's "balance" collection: router biases and accumulated loads per MoE layer
  rng: jax.Array  # raw uint32 key data
  bad_steps: jax.Array  # consecutive non-finite steps (the update was skipped)


def logical_axes(boxed_params):
  """Tree of logical-axis tuples, one per parameter, from nn.Partitioned boxes."""
  return jax.tree.map(lambda p: tuple(p.names) if isinstance(p, nn.Partitioned) else (None,) * p.ndim,
                      boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def is_logical_axes(x) -> bool:
  """Whether x is a leaf of a `logical_axes` tree: a tuple of axis names (or None)."""
  return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def head_matrix(params, cfg_model):
  return tied_head(params["embedding"]) if cfg_model.tie_embeddings else params["head"]


def init_state(model: Transformer, config, rng: jax.Array, total_steps: int):
  """Returns (state, optimizer, logical_axes); the state lives on the first local device."""
  init_rng, state_rng = jax.random.split(rng)
  state_rng = jax.random.key_data(state_rng)  # raw uint32, which checkpoints as a plain array
  variables = init_variables(model, init_rng)
  axes = logical_axes(variables["params"])
  params = nn.unbox(variables["params"])
  optimizer = make_optimizer(config.optim, axes, total_steps)
  state = TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=jax.jit(optimizer.init)(params),
      balance=variables.get("balance", {}), rng=state_rng,
      bad_steps=jnp.zeros((), jnp.int32))
  # Committed to the device, as a restored checkpoint is: otherwise a fresh and a resumed run lower
  # the step with different sharding annotations and each compiles it anew.
  state = jax.device_put(state, jax.local_devices()[0])
  return state, optimizer, axes


def shard_state(state: TrainState, axes, mesh) -> TrainState:
  """`state` placed on `mesh` by `state_shardings`. Run the step under `jax.set_mesh(mesh)`."""
  return jax.device_put(state, state_shardings(state, axes, mesh))


def state_shardings(state: TrainState, axes, mesh) -> TrainState:
  """Where each leaf of `state` (arrays or their shapes) goes on `mesh`: params split by their logical
  axes (moejax.parallel.mesh rules), each optimizer-state leaf that mirrors a parameter (a moment:
  its path ends in the parameter's path, with its shape) as that parameter, everything else
  replicated. Give the result to `jit_train_step` too, so that the step hands the state back as it
  takes it."""
  params = jax.tree.map(lambda names, p: meshlib.named_sharding(names, p.shape, mesh), axes, state.params,
                        is_leaf=is_logical_axes)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  by_path = {tuple(k.key for k in path): (tuple(p.shape), sharding) for (path, p), sharding in
             zip(jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(params), strict=True)}

  def follow(path, leaf):
    keys = []  # the dict keys that end the leaf's path: where a params-shaped tree sits in the state
    for k in reversed(path):
      if not isinstance(k, jax.tree_util.DictKey):
        break
      keys.insert(0, k.key)
    for i in range(len(keys)):
      shape, sharding = by_path.get(tuple(keys[i:]), (None, None))
      if shape == tuple(leaf.shape):
        return sharding
    return replicated

  return state.replace(params=params, opt_state=jax.tree_util.tree_map_with_path(follow, state.opt_state),
                       balance=jax.tree.map(lambda _: replicated, state.balance),
                       step=replicated, rng=replicated, bad_steps=replicated)


def _sum_leaves(tree, name):
  leaves = [v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]
            if any(getattr(k, "key", None) == name for k in path)]
  return sum((jnp.sum(v) for v in leaves), jnp.zeros((), jnp.float32))


def _mla_max_logits(attn_stats):
  """{param path prefix of an MLA layer: [heads] max logit ([layers, heads] for scanned layers)} from
  the sown "attn_stats" collection (a tuple of one entry per call of the layer)."""
  sown = {}
  for path, v in jax.tree_util.tree_flatten_with_path(attn_stats)[0]:
    keys = tuple(getattr(k, "key", k) for k in path)
    if "max_logit" in keys:
      sown.setdefault(keys[:keys.index("max_logit")], []).append(v)
  return {prefix: jnp.max(jnp.stack(vs), axis=0) for prefix, vs in sown.items()}


# How each sown statistic of a pass combines over a step's passes (train_step's `accumulated`), given
# the passes' shares of the batch's documents: the aux loss is a mean over documents.
_PASS_COMBINE = {"load": lambda x, _: jnp.sum(x, 0), "dropped": lambda x, _: jnp.sum(x, 0),
                 "aux_loss": lambda x, docs_P: jnp.tensordot(docs_P, x, 1), "bias_next": lambda x, _: x[-1],
                 "max_logit": lambda x, _: jnp.max(x, 0)}


def _combine_passes(stats_P, documents_P):
  """The sown collections of a step's passes (each leaf stacked over passes, axis 0) as one step's:
  `_PASS_COMBINE` by the statistic's name; documents_P [passes]: each pass's share of the documents."""
  def combine(path, x):
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in _PASS_COMBINE]
    if not names:
      raise ValueError(f"no rule combines the sown statistic {jax.tree_util.keystr(path)} over a step's "
                       f"passes (train.microbatch_tokens): add one to _PASS_COMBINE")
    return _PASS_COMBINE[names[-1]](x, documents_P)

  return jax.tree_util.tree_map_with_path(combine, stats_P)


class _AccumulatorLayout:
  """How `accumulated` sums the passes' gradients: in float32 (or the parameter's wider type), and
  the gradients of the parameters that `optim.flattens` (small and unsplit) as one flat float32
  vector: a few kernels a pass for all of them, not one per parameter.

  The routed experts' float32 weights (moe.EXPERT_WEIGHTS, most of the parameters) that are not in
  the flat vector are accumulated by the model itself: their accumulators go in as the collection
  nn.GRAD_ACC and their gradients come back with the accumulator already added, on GPU by the grouped
  matmul's drhs kernel, over the accumulator's buffer. That saves writing each pass's gradient and
  reading it back for a separate add, and the pass's gradient is not rounded to the compute dtype
  before the sum (a one-pass step's is).
  """

  def __init__(self, params):
    paths_and_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [p for _, p in paths_and_leaves]
    self.shapes = [(p.shape, p.dtype) for p in leaves]
    self.small = [optim_lib.flattens(p) for p in leaves]
    self.flat_size = sum(p.size for p, s in zip(leaves, self.small, strict=True) if s)
    keys = [tuple(getattr(k, "key", None) for k in path) for path, _ in paths_and_leaves]
    # Paths into the collection for the leaves the model accumulates, None for the others.
    self.in_model = [key if not s and p.dtype == jnp.float32 and key[-1] in EXPERT_WEIGHTS
                     and None not in key else None
                     for key, p, s in zip(keys, leaves, self.small, strict=True)]

  def collection(self, acc):
    """The nn.GRAD_ACC collection: the model-accumulated leaves' accumulators at their params' paths."""
    return traverse_util.unflatten_dict({key: a for key, a in zip(self._large(self.in_model), acc[0],
                                                                    strict=True) if key is not None})

  def _large(self, per_leaf):
    """The entries of a per-leaf list that belong to the large leaves (those with accumulators)."""
    return [x for x, s in zip(per_leaf, self.small, strict=True) if not s]

  def zeros(self):
    """(one zero accumulator per large gradient, the flat zero vector of the small ones)."""
    large = [jnp.zeros(shape, jnp.promote_types(dtype, jnp.float32))
             for shape, dtype in self._large(self.shapes)]
    return large, jnp.zeros((self.flat_size,), jnp.float32)

  def add(self, acc, grads):
    large, flat = acc
    leaves = self.treedef.flatten_up_to(grads)
    large_g = self._large(leaves)
    small_g = [g.astype(jnp.float32).reshape(-1) for g, s in zip(leaves, self.small, strict=True) if s]
    # A model-accumulated gradient already holds the accumulator.
    large = [g if key is not None else a + g.astype(a.dtype)
             for a, g, key in zip(large, large_g, self._large(self.in_model), strict=True)]
    if small_g:
      flat = flat + jnp.concatenate(small_g)
    return large, flat

  def gradients(self, acc):
    """The summed gradients as the params' tree, each in its parameter's dtype."""
    large, flat = iter(acc[0]), acc[1]
    out, offset = [], 0
    for (shape, dtype), s in zip(self.shapes, self.small, strict=True):
      if s:
        size = math.prod(shape)
        out.append(flat[offset:offset + size].reshape(shape).astype(dtype))
        offset += size
      else:
        out.append(next(large).astype(dtype))
    return jax.tree.unflatten(self.treedef, out)


def _module_paths(tree, depth: int) -> set:
  """The paths of the leaves of a nested dict, each cut `depth` keys short: their modules' paths."""
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(getattr(k, "key", k) for k in path[:-depth]) for path, _ in paths}


def _check_taken(grad_acc, taken):
  """Raises unless every module handed gradient accumulators sowed that it took them (trace time)."""
  # An accumulator sits at module/param; a marker at module/name/(the sow's tuple index).
  if missing := _module_paths(grad_acc, 1) - _module_paths(taken, 2):
    raise ValueError(f"the model did not take the gradient accumulators of {sorted(missing)}: their "
                     f"earlier passes' gradients would be lost")


def applied_updates(opt_state) -> jax.Array:
  """How many updates the optimizer has applied: its step `count`. Skipped (non-finite) steps keep
  the whole old optimizer state, so every count in the chain stays equal to this."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if getattr(path[-1], "name", getattr(path[-1], "key", None)) == "count":
      return leaf
  raise ValueError("the optimizer state holds no step count")


def make_train_step(model: Transformer, optimizer: optax.GradientTransformation, config, total_steps: int):
  """total_steps: the length the optimizer's schedule was built for (`init_state`), for the lr metric."""
  cfg = config.model
  schedule = learning_rate_schedule(config.optim, total_steps)
  adam_schedule = learning_rate_schedule(dict_to_cfg(config.optim, lr=config.optim.adam_lr), total_steps)
  # Max attention logits cost an extra QK^T pass, so they are collected only when QK-clip uses them.
  mutable = ["router", "attn_stats"] if config.optim.qk_clip_tau > 0 else ["router"]

  def loss_fn(params, balance_vars, batch, ce_weight=1.0, aux_weight=1.0, grad_acc=None):
    """ce_weight * cross-entropy + aux_weight * the MoE aux losses, for one pass over `batch`.
    grad_acc: the nn.GRAD_ACC collection (gradient accumulators the model adds in), or None."""
    variables = {"params": params, "balance": balance_vars}
    if grad_acc:
      variables[GRAD_ACC] = grad_acc
    h_BTD, stats = model.apply(variables, batch["tokens"], batch["segment_ids"],
                               mutable=mutable + [GRAD_ACC_TAKEN] if grad_acc else mutable)
    if grad_acc:
      _check_taken(grad_acc, stats.pop(GRAD_ACC_TAKEN, {}))
    with jax.named_scope("lm_head_loss"):
      loss, metrics = cross_entropy(h_BTD, head_matrix(params, cfg), batch["targets"], batch["loss_mask"],
                                    z_loss_weight=cfg.loss.z_loss_weight, chunk=cfg.loss.chunk_tokens)
    aux = _sum_leaves(stats.get("router", {}), "aux_loss")
    metrics["aux_loss"] = aux
    return ce_weight * loss + aux_weight * aux, (metrics, stats)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulated(params, balance_vars, batch, passes: int):
    """(loss, (metrics, stats), grads, balance after the last pass) of the batch in `passes` passes
    (train.microbatch_tokens), weighted so that the passes' losses and gradients sum to the whole
    batch's: with a bias that does not move between passes ("none", "aux"), those of the batch in one
    pass.

    Pass p takes rows p, p + passes, ...: a row shard, a contiguous block of rows, holds its share of
    every pass. The cross-entropy is weighted by each pass's share of the batch's loss-mask weight and
    the sequence-wise aux loss (a mean over documents) by its share of the batch's documents, so the
    summed loss and gradients are the whole batch's. Each pass routes with the balance state the pass
    before it left (causal, as between steps), so a step of n passes makes n balance updates: n sign
    steps under "sign", the last pass's bias under "quantile". The router loads, drops, aux losses and
    max attention logits are combined over the passes (`_PASS_COMBINE`), so the step's balance metrics
    (MaxVio, load shares) are those of its summed loads, not of the worst pass.
    """
    rows_PB = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // passes, passes, *x.shape[1:]),
                                                  0, 1), batch)
    total = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
    # Documents never cross rows: a row holds its last document index + 1 of them.
    documents = lambda seg_BT: jnp.sum(document_ids(seg_BT)[:, -1] + 1).astype(jnp.float32)
    total_documents = documents(batch["segment_ids"])

    layout = _AccumulatorLayout(params)

    def one_pass(carry, rows):
      acc, balance = carry
      # A pass's cross-entropy is its masked sum over max(its mask's sum, 1), as the batch's is over
      # `total`: weighted so, fractional masks with sums below 1 come out right too.
      ce_weight = jnp.maximum(jnp.sum(rows["loss_mask"].astype(jnp.float32)), 1.0) / total
      aux_weight = documents(rows["segment_ids"]) / total_documents
      (loss, (metrics, stats)), grads = grad_fn(params, balance, rows, ce_weight, aux_weight,
                                                layout.collection(acc))
      with jax.named_scope("accumulate"):
        acc = layout.add(acc, grads)
      balance = balance_lib.next_balance_state(cfg.moe.balance, balance, stats.get("router", {}), cfg.moe)
      return (acc, balance), (loss, (ce_weight, aux_weight), metrics, stats)

    (acc, balance), (loss_P, (ce_P, aux_P), metrics_P, stats_P) = jax.lax.scan(
        one_pass, (layout.zeros(), balance_vars), rows_PB)
    grads = layout.gradients(acc)
    # Per-token means weighted by tokens, the aux loss's per-document mean by documents.
    per_token, per_document = (lambda x: jnp.sum(ce_P * x)), (lambda x: jnp.sum(aux_P * x))
    combine = {"nll": per_token, "z_loss": per_token, "tokens": jnp.sum, "aux_loss": per_document}
    if unknown := set(metrics_P) - set(combine):
      raise ValueError(f"no rule combines the metrics {sorted(unknown)} over a step's passes")
    metrics = {name: combine[name](x) for name, x in metrics_P.items()}
    return jnp.sum(loss_P), (metrics, _combine_passes(stats_P, aux_P)), grads, balance

  def train_step(state: TrainState, batch):
    B, T = batch["tokens"].shape
    passes = passes_per_step(T, B * T, config.train.microbatch_tokens)
    if passes == 1:
      (loss, (metrics, stats)), grads = grad_fn(state.params, state.balance, batch)
      new_balance = balance_lib.next_balance_state(cfg.moe.balance, state.balance, stats.get("router", {}),
                                                   cfg.moe)
    else:
      loss, (metrics, stats), grads, new_balance = accumulated(state.params, state.balance, batch, passes)
    # The named scopes label the step's parts in profiles (benchmarks/trace_parts.py).
    with jax.named_scope("optimizer"):
      grad_norm = optim_lib.global_norm(grads)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      if config.optim.qk_clip_tau > 0:
        params = qk_clip(params, _mla_max_logits(stats.get("attn_stats", {})), config.optim.qk_clip_tau)
    router_stats = stats.get("router", {})

    # A non-finite loss or gradient skips the whole update, balance state included.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    next_state = TrainState(
        step=state.step + 1, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
        balance=keep(new_balance, state.balance), rng=jax.random.fold_in(state.rng, state.step),
        bad_steps=jnp.where(finite, 0, state.bad_steps + 1))
    # The rate this update used: the schedule follows the optimizer's count, which a skipped step
    # does not advance, so after skips it lags the step.
    count = applied_updates(state.opt_state)
    lrs = {"lr": schedule(count)}
    if config.optim.name == "muon":
      lrs["adam_lr"] = adam_schedule(count)
    metrics = {**metrics, **lrs, "loss": loss, "grad_norm": grad_norm, "finite": finite,
               "bad_steps": next_state.bad_steps,
               **metrics_lib.balance_metrics(per_layer(router_stats, cfg), per_layer(new_balance, cfg),
                                             cfg.moe.top_k)}
    return next_state, metrics

  return train_step


def compiler_options(config) -> dict:
  """The XLA options that the train and eval steps compile with (config.train). The GPU ones are
  passed only when they turn something off, so that XLA_FLAGS still set them otherwise."""
  t = config.train
  options = {"xla_allow_excess_precision": t.allow_excess_precision}
  if not t.xla_triton_gemm:
    options["xla_gpu_enable_triton_gemm"] = False
  if not t.xla_dot_merger:
    options["xla_gpu_dot_merger_threshold_mb"] = 0
  return options


def jit_train_step(model: Transformer, optimizer: optax.GradientTransformation, config, total_steps: int,
                   shardings: TrainState | None = None):
  """`make_train_step` jitted as runs use it: the state donated, `compiler_options` applied, and with
  `shardings` (`state_shardings`) the new state placed as the old one. Left to XLA, an output may come
  back placed otherwise than its input (a moment that follows its gradient), and the next call would
  then compile the step again, or refuse an ahead-of-time compiled one."""
  return jax.jit(make_train_step(model, optimizer, config, total_steps), donate_argnums=0,
                 out_shardings=None if shardings is None else (shardings, None),
                 compiler_options=compiler_options(config))


def jit_eval_step(model: Transformer, config):
  return jax.jit(make_eval_step(model, config), compiler_options=compiler_options(config))


def make_eval_step(model: Transformer, config):
  cfg = config.model

  def eval_step(state: TrainState, batch):
    h_BTD, _ = model.apply({"params": state.params, "balance": state.balance},
                           batch["tokens"], batch["segment_ids"], mutable=["router"])
    _, metrics = cross_entropy(h_BTD, head_matrix(state.params, cfg), batch["targets"], batch["loss_mask"],
                               chunk=cfg.loss.chunk_tokens)
    return metrics

  return eval_step
