"""What a row's decode caches cost, against the key-value cache of plain multi-head attention.

The hybrid's KDA layers keep a fixed-size state (float32 [H, K, V] and the short convolutions' last
W-1 inputs) whatever the context; its MLA layers keep one normalised kv latent (kv_lora_rank numbers)
per token. A plain multi-head model of the same shape would cache heads x (qk + v) numbers per token in
every layer.
"""

import math

import jax

from moejax.layout import layer_kinds
from moejax.model import init_cache


def cache_bytes(cfg_model, context: int) -> int:
  """Bytes of one row's decode caches (`moejax.model.init_cache`) holding `context` tokens."""
  shapes = jax.eval_shape(lambda: init_cache(cfg_model, 1, context))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def multi_head_kv_bytes_per_token(cfg_model) -> int:
  """Bytes per token of a plain multi-head KV cache of the same model: every layer attending with the
  MLA layers' heads and widths, keys and values in the compute dtype."""
  a = cfg_model.mla
  itemsize = jax.numpy.dtype(cfg_model.dtype).itemsize
  return cfg_model.num_layers * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * itemsize


def footprint(cfg_model, context: int) -> dict:
  """A row's cache at `context` tokens: total bytes, bytes per token of context, the plain multi-head
  cache's bytes per token, and their ratio (ours over plain)."""
  total = cache_bytes(cfg_model, context)
  kinds = [mixer for mixer, _ in layer_kinds(cfg_model)]
  plain = multi_head_kv_bytes_per_token(cfg_model)
  return {"context": context, "bytes": total, "bytes_per_token": total / context,
          "kda_layers": kinds.count("kda"), "mla_layers": kinds.count("mla"),
          "multi_head_bytes_per_token": plain, "ratio": total / context / plain}
