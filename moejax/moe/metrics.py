"""MoE balance metrics for logging, from the sown "router" stats and the "balance" state.

MaxVio = (max_j load_j - mean_j load_j) / mean_j load_j (Wang et al., loss-free balancing):
MaxVio_batch uses this batch's load; MaxVio_global the load accumulated in the balance state
(`load_total`, see moejax/moe/balance.py). top_share is the fraction of this batch's tokens that
chose the most loaded expert (k/n when perfectly balanced).
"""

from collections.abc import Mapping

import jax.numpy as jnp


def maxvio(load_E):
  """(max - mean) / mean over the last axis; 0 for a perfectly balanced load."""
  load = jnp.asarray(load_E, jnp.float32)
  mean = jnp.mean(load, axis=-1)
  return (jnp.max(load, axis=-1) - mean) / jnp.maximum(mean, 1e-9)


def _layers(tree, path=()):
  """Yields (path, leaf dict) for every MoE layer (a mapping holding 'load' or 'bias')."""
  if not isinstance(tree, Mapping):
    return
  if "load" in tree or "bias" in tree:
    yield path, tree
    return
  for key, sub in tree.items():
    yield from _layers(sub, (*path, str(key)))


def expert_loads(router_stats) -> dict[str, jnp.ndarray]:
  """Per-layer expert load vectors [n] of this batch, keyed by module path ("layer_3/moe")."""
  return {"/".join(path): jnp.asarray(stats["load"]) for path, stats in _layers(router_stats)}


def balance_metrics(router_stats, balance_vars=None, top_k: int = 1, prefix: str = "moe") -> dict:
  """Flat dict: per layer the expert load vector `load` [n] (over its mean, so 1 is a fair share)
  and the scalars maxvio_batch, top_share, load_min/load_max (over the mean), dropped, and with
  `balance_vars` (the state after this step's update) maxvio_global; plus their means over layers
  (maxvio_batch, maxvio_global), the summed aux_loss and the total dropped."""
  out = {}
  totals = dict(_layers(balance_vars)) if balance_vars is not None else {}
  batch, glob, dropped, aux = [], [], [], []
  for path, stats in _layers(router_stats):
    name = f"{prefix}/{'/'.join(path)}"
    load = jnp.asarray(stats["load"], jnp.float32)
    mean = jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    tokens = jnp.maximum(jnp.sum(load, axis=-1) / top_k, 1e-9)
    out[f"{name}/load"] = load / mean[..., None]
    out[f"{name}/maxvio_batch"] = maxvio(load)
    out[f"{name}/top_share"] = jnp.max(load, axis=-1) / tokens
    out[f"{name}/load_max"] = jnp.max(load, axis=-1) / mean
    out[f"{name}/load_min"] = jnp.min(load, axis=-1) / mean
    batch.append(out[f"{name}/maxvio_batch"])
    if "dropped" in stats:
      out[f"{name}/dropped"] = jnp.asarray(stats["dropped"])
      dropped.append(out[f"{name}/dropped"])
    if "aux_loss" in stats:
      aux.append(jnp.asarray(stats["aux_loss"]))
    if path in totals:
      out[f"{name}/maxvio_global"] = maxvio(totals[path]["load_total"])
      glob.append(out[f"{name}/maxvio_global"])
  if batch:
    out[f"{prefix}/maxvio_batch"] = jnp.mean(jnp.stack(batch))
  if glob:
    out[f"{prefix}/maxvio_global"] = jnp.mean(jnp.stack(glob))
  if dropped:
    out[f"{prefix}/dropped"] = jnp.sum(jnp.stack(dropped))
  if aux:
    out[f"{prefix}/aux_loss"] = jnp.sum(jnp.stack(aux))
  return out
