"""The jitted programs of generation: prefill a piece of each row into the caches, and decode on the
device until every row has finished.

Shapes are bucketed so that a stream of requests compiles a bounded number of programs: rows to a
power of two, prompt pieces to a power of two up to `inference.prefill_chunk`, and the cache length
to a power of two up to `inference.cache_len` (`bucket`). The cache, the next-token logits and the
per-row counters live on the device between calls (`Rows`); the host only reads the tokens back.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.inference.sampling import Sampling, sample
from moejax.model import Transformer, init_cache
from moejax.moe import replay


def bucket(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum)."""
  n = max(int(n), minimum, 1)
  return 1 << (n - 1).bit_length()


class RoutingRecord(NamedTuple):
  """The experts every fed position took, per MoE layer (routing replay, moejax/moe/replay.py).

  experts_BSLK: int32 [B, positions, MoE layers, k], -1 where nothing was fed yet. fed_B: positions
  filled per row."""

  experts_BSLK: jax.Array
  fed_B: jax.Array

  @classmethod
  def empty(cls, cfg_model, batch: int, length: int) -> "RoutingRecord":
    layers = len(replay.moe_layers(cfg_model))
    return cls(jnp.full((batch, length, layers, cfg_model.moe.top_k), replay.NOT_REPLAYED, jnp.int32),
               jnp.zeros((batch,), jnp.int32))

  def written(self, experts_BTLK, lengths_B) -> "RoutingRecord":
    """The record after each row's first lengths_B[b] positions of a piece took experts_BTLK."""
    B, T = experts_BTLK.shape[:2]
    t_T = jnp.arange(T, dtype=jnp.int32)
    pos_BT = jnp.where(t_T[None] < lengths_B[:, None], self.fed_B[:, None] + t_T[None],
                       self.experts_BSLK.shape[1])  # padding: out of range, dropped
    experts = self.experts_BSLK.at[jnp.arange(B)[:, None], pos_BT].set(experts_BTLK, mode="drop")
    return RoutingRecord(experts, self.fed_B + lengths_B)

  def grown(self, length: int) -> "RoutingRecord":
    pad = length - self.experts_BSLK.shape[1]
    if pad <= 0:
      return self
    return self._replace(experts_BSLK=jnp.pad(self.experts_BSLK, ((0, 0), (0, pad), (0, 0), (0, 0)),
                                              constant_values=replay.NOT_REPLAYED))


class Rows(NamedTuple):
  """What the device keeps of a batch of rows between calls.

  cache: the model's decode caches (`moejax.model.init_cache`). logits_BV: float32, each row's logits
  for its next token (after its last fed token). done_B: the row takes no more tokens this turn.
  drawn_B: tokens sampled for the row so far, over all turns (each draw's key is the row's key folded
  with this count, so what a row samples does not depend on how the decoding is cut into calls, nor on
  the rest of the batch). limit_B: drawn_B at which the row stops this turn (max_new_tokens reached).
  routing: the experts each fed position took (`RoutingRecord`), or None: not recorded.
  """

  cache: dict
  logits_BV: jax.Array
  done_B: jax.Array
  drawn_B: jax.Array
  limit_B: jax.Array
  routing: RoutingRecord | None = None

  @classmethod
  def empty(cls, cfg_model, batch: int, length: int, record_routing: bool = False) -> "Rows":
    """Rows with empty caches of `length` positions, all done, nothing drawn; with `record_routing`, a
    `RoutingRecord` of as many positions."""
    return cls(init_cache(cfg_model, batch, length), jnp.zeros((batch, cfg_model.vocab_size), jnp.float32),
               jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32),
               RoutingRecord.empty(cfg_model, batch, length) if record_routing else None)


def grow_cache(cache: dict, length: int) -> dict:
  """The caches with room for `length` positions: the MLA latents padded (KDA states have no length)."""
  def grow(path, x):
    if getattr(path[-1], "key", None) != "latent" or x.shape[-2] >= length:
      return x
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, length - x.shape[-2])
    return jnp.pad(x, pad)

  return jax.tree_util.tree_map_with_path(grow, cache)


def cache_length(cache: dict) -> int:
  """Positions the caches hold per row (the MLA latents' length); 0 for a model of KDA layers only."""
  lengths = [x.shape[-2] for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]
             if getattr(path[-1], "key", None) == "latent"]
  return max(lengths, default=0)


def _last_logits(model: Transformer, variables, h_BTD, lengths_B):
  last_BD = jnp.take_along_axis(h_BTD, jnp.maximum(lengths_B - 1, 0)[:, None, None], axis=1)[:, 0]
  return model.apply(variables, last_BD[:, None], method=Transformer.logits)[:, 0]


def prefill_piece(model: Transformer, variables, rows: Rows, tokens_BT, lengths_B) -> Rows:
  """The prefill program: `append` (a function of its own, so that the programs can be counted)."""
  return append(model, variables, rows, tokens_BT, lengths_B)


def append(model: Transformer, variables, rows: Rows, tokens_BT, lengths_B, embeddings_BTD=None) -> Rows:
  """Appends each row's first lengths_B[b] tokens of tokens_BT (or, given instead, of embeddings_BTD:
  a prompt whose images are in place) to its caches; a row that took any gets the logits after its last
  one. Rows that take none are left as they were. Rows with a `RoutingRecord` record the experts the
  tokens took."""
  mutable = False if rows.routing is None else [replay.ROUTING]
  if embeddings_BTD is None:
    out = model.apply(variables, tokens_BT, cache=rows.cache, lengths_B=lengths_B, mutable=mutable)
  else:
    out = model.apply(variables, embeddings_BTD=embeddings_BTD, cache=rows.cache, lengths_B=lengths_B,
                      mutable=mutable)
  (h_BTD, cache), sown = out if mutable else (out, None)
  routing = rows.routing
  if routing is not None:
    routing = routing.written(replay.stack(sown[replay.ROUTING], model.cfg), lengths_B)
  logits_BV = _last_logits(model, variables, h_BTD, lengths_B)
  logits_BV = jnp.where((lengths_B > 0)[:, None], logits_BV, rows.logits_BV)
  return rows._replace(cache=cache, logits_BV=logits_BV, routing=routing)


def decode_block(model: Transformer, variables, rows: Rows, keys_B, eos_id, *, steps: int,
                 sampling: Sampling):
  """Up to `steps` decode steps, on the device, stopping early once every row is done.

  Each step draws a token for every row that is not done from its logits, and feeds it back through
  the model unless that token ends the row (eos_id, or the row's limit): the last token of a turn is
  drawn but not fed, so a conversation's next turn starts by feeding it. eos_id < 0: none.

  Returns (rows, tokens [B, steps] int32, logprobs [B, steps] float32, taken [B, steps] bool): step i's
  token of each row, and whether the row drew one at step i.
  """
  B = rows.done_B.shape[0]

  def body(carry):
    i, rows, out_tokens, out_logp, out_taken = carry
    keys = jax.vmap(jax.random.fold_in)(keys_B, rows.drawn_B)
    tokens_B, logp_B = sample(rows.logits_BV, keys, sampling)
    active_B = ~rows.done_B
    drawn_B = rows.drawn_B + active_B
    ends_B = active_B & ((tokens_B == eos_id) | (drawn_B >= rows.limit_B))
    rows = rows._replace(done_B=rows.done_B | ends_B, drawn_B=drawn_B)
    fed_B = active_B & ~ends_B
    # A one-token prefill of the rows that go on, run even when none does (those that take no token are
    # left as they were): a lax.cond on "any row goes on" would make the GPU hand its predicate to the
    # host every step, which then waits on it.
    rows = append(model, variables, rows, tokens_B[:, None], fed_B.astype(jnp.int32))
    out_tokens = out_tokens.at[:, i].set(jnp.where(active_B, tokens_B, -1))
    out_logp = out_logp.at[:, i].set(jnp.where(active_B, logp_B, 0.0))
    out_taken = out_taken.at[:, i].set(active_B)
    return i + 1, rows, out_tokens, out_logp, out_taken

  def cond(carry):
    i, rows = carry[:2]
    return (i < steps) & ~jnp.all(rows.done_B)

  init = (jnp.zeros((), jnp.int32), rows, jnp.full((B, steps), -1, jnp.int32),
          jnp.zeros((B, steps), jnp.float32), jnp.zeros((B, steps), bool))
  _, rows, tokens, logp, taken = jax.lax.while_loop(cond, body, init)
  return rows, tokens, logp, taken


class Engine:
  """The two programs of one model, jitted once: `prefill` and `decode`. The caches are donated: a
  call's `Rows` replace the ones it was given, which must not be used again."""

  def __init__(self, model: Transformer, variables):
    self.model = model
    self.variables = variables
    self._prefill = jax.jit(lambda v, r, t, n: prefill_piece(model, v, r, t, n), donate_argnums=(1,))
    self._decode = jax.jit(lambda v, r, k, e, steps, sampling: decode_block(
        model, v, r, k, e, steps=steps, sampling=sampling), static_argnums=(4, 5), donate_argnums=(1,))
    self._embed_images = jax.jit(lambda v, t, im: model.apply(v, t, im, method=Transformer.embed_images))
    self._prefill_embedded = jax.jit(lambda v, r, x, n: append(model, v, r, None, n, x), donate_argnums=(1,))

  def prefill(self, rows: Rows, tokens_BT, lengths_B) -> Rows:
    return self._prefill(self.variables, rows, tokens_BT, lengths_B)

  def embed_images(self, tokens_BT, images: dict):
    """The embeddings [B,T,D] of rows of tokens whose image placeholders take their images' tokens
    (`Transformer.embed_images`), for `prefill_embedded`."""
    return self._embed_images(self.variables, tokens_BT, images)

  def prefill_embedded(self, rows: Rows, embeddings_BTD, lengths_B) -> Rows:
    return self._prefill_embedded(self.variables, rows, embeddings_BTD, lengths_B)

  def decode(self, rows: Rows, keys_B, eos_id: int, steps: int, sampling: Sampling):
    return self._decode(self.variables, rows, keys_B, jnp.int32(eos_id), int(steps), sampling)
