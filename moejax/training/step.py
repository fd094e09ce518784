"""The one jitted step that advances the train state, and the evaluation step.

Both take the loss as an argument (`moejax.training.loss.LossFn`): next-token cross-entropy for
pretraining (`next_token_loss`, the default); a post-training objective passes its own.
"""

import jax
import jax.numpy as jnp
import optax

from moejax.config import passes_per_step
from moejax.layers.packing import Packing
from moejax.model import Transformer, per_layer
from moejax.moe import balance as balance_lib
from moejax.moe import metrics as metrics_lib
from moejax.moe import replay
from moejax.nn import GRAD_ACC, GRAD_ACC_TAKEN
from moejax.training import optimizers as optim_lib
from moejax.training.accumulation import AccumulatorLayout, check_taken, combine_passes
from moejax.training.loss import LossFn, next_token_loss
from moejax.training.optimizers import dict_to_cfg, learning_rate_schedule, qk_clip
from moejax.training.state import TrainState, applied_updates, head_matrix
from moejax.vision.batch import images_of


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


def replayed_routing(batch, cfg_model) -> dict:
  """{REPLAY: the collection} where the batch carries "replay_experts" (routing replay,
  moejax/moe/replay.py), else {}."""
  if "replay_experts" not in batch:
    return {}
  return {replay.REPLAY: replay.unstack(batch["replay_experts"], cfg_model)}


def make_train_step(model: Transformer, optimizer: optax.GradientTransformation, config, total_steps: int,
                    loss_fn: LossFn = next_token_loss):
  """total_steps: the length the optimizer's schedule was built for (`init_state`), for the lr metric.
  loss_fn: the objective of the model's final hidden states (`moejax.training.loss.LossFn`); the MoE's
  aux losses are added to it."""
  cfg = config.model
  schedule = learning_rate_schedule(config.optim, total_steps)
  adam_schedule = learning_rate_schedule(dict_to_cfg(config.optim, lr=config.optim.adam_lr), total_steps)
  # Max attention logits cost an extra QK^T pass, so they are collected only when QK-clip uses them.
  mutable = ["router", "attn_stats"] if config.optim.qk_clip_tau > 0 else ["router"]

  def objective(params, balance_vars, batch, ce_weight=1.0, aux_weight=1.0, grad_acc=None):
    """ce_weight * loss_fn + aux_weight * the MoE aux losses, for one pass over `batch`.
    grad_acc: the nn.GRAD_ACC collection (gradient accumulators the model adds in), or None."""
    variables = {"params": params, "balance": balance_vars, **replayed_routing(batch, cfg)}
    if grad_acc:
      variables[GRAD_ACC] = grad_acc
    (h_BTD, _), stats = model.apply(variables, batch["tokens"], batch["segment_ids"], images=images_of(batch),
                                    mutable=mutable + [GRAD_ACC_TAKEN] if grad_acc else mutable)
    if grad_acc:
      check_taken(grad_acc, stats.pop(GRAD_ACC_TAKEN, {}))
    with jax.named_scope("lm_head_loss"):
      loss, metrics = loss_fn(h_BTD, head_matrix(params, cfg), batch, cfg)
    if "aux_loss" in metrics:
      raise ValueError("loss_fn's metrics may not name 'aux_loss': the step reports the MoE's under it")
    aux = _sum_leaves(stats.get("router", {}), "aux_loss")
    metrics = {**metrics, "aux_loss": aux}
    return ce_weight * loss + aux_weight * aux, (metrics, stats)

  grad_fn = jax.value_and_grad(objective, has_aux=True)

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
    documents = lambda seg_BT: jnp.sum(Packing.of(seg_BT, *seg_BT.shape).documents_B()).astype(jnp.float32)
    total_documents = documents(batch["segment_ids"])

    layout = AccumulatorLayout(params)

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
    # Per-token means (the LossFn contract), except the token count and the per-document aux loss.
    combine = {"tokens": jnp.sum, "aux_loss": per_document}
    metrics = {name: combine.get(name, per_token)(x) for name, x in metrics_P.items()}
    return jnp.sum(loss_P), (metrics, combine_passes(stats_P, aux_P)), grads, balance

  def train_step(state: TrainState, batch):
    B, T = batch["tokens"].shape
    passes = passes_per_step(T, B * T, config.train.microbatch_tokens)
    if passes == 1:
      (loss, (metrics, stats)), grads = grad_fn(state.params, state.balance, batch)
      new_balance = balance_lib.next_balance_state(cfg.moe.balance, state.balance, stats.get("router", {}),
                                                   cfg.moe)
    else:
      loss, (metrics, stats), grads, new_balance = accumulated(state.params, state.balance, batch, passes)
    # The named scopes label the step's parts in profiles (tools/trace_parts.py).
    with jax.named_scope("optimizer"):
      grad_norm = optim_lib.global_norm(grads)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      if config.optim.qk_clip_tau > 0:
        params = qk_clip(params, _mla_max_logits(stats.get("attn_stats", {})), config.optim.qk_clip_tau)
    if not config.train.update_params:  # the diagnostic of a router that does not move (config.py)
      params, opt_state = state.params, state.opt_state
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
                   shardings: TrainState | None = None, loss_fn: LossFn = next_token_loss):
  """`make_train_step` jitted as runs use it: the state donated, `compiler_options` applied, and with
  `shardings` (`state_shardings`) the new state placed as the old one. Left to XLA, an output may come
  back placed otherwise than its input (a moment that follows its gradient), and the next call would
  then compile the step again, or refuse an ahead-of-time compiled one."""
  return jax.jit(make_train_step(model, optimizer, config, total_steps, loss_fn), donate_argnums=0,
                 out_shardings=None if shardings is None else (shardings, None),
                 compiler_options=compiler_options(config))


def jit_eval_step(model: Transformer, config, loss_fn: LossFn = next_token_loss):
  return jax.jit(make_eval_step(model, config, loss_fn), compiler_options=compiler_options(config))


def make_eval_step(model: Transformer, config, loss_fn: LossFn = next_token_loss):
  """(state, batch) -> loss_fn's metrics of the batch, the model applied without updating anything."""
  cfg = config.model

  def eval_step(state: TrainState, batch):
    (h_BTD, _), _ = model.apply({"params": state.params, "balance": state.balance,
                                 **replayed_routing(batch, cfg)},
                                batch["tokens"], batch["segment_ids"], images=images_of(batch),
                                mutable=["router"])
    _, metrics = loss_fn(h_BTD, head_matrix(state.params, cfg), batch, cfg)
    return metrics

  return eval_step
