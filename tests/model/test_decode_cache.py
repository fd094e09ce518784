"""The decode-cache seam: the model and its mixers continue a row from a cache, `(x, cache) -> (y, cache)`,
and give what the whole row gives at once. Float32 on the XLA paths, so the two orders of summation agree
to float rounding."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.config import base_config
from moejax.layers.kda import KDA, init_kda_cache
from moejax.layers.mla import GatedMLA, init_mla_cache
from moejax.layers.packing import Appended, Packing
from moejax.model import build_model, init_cache, stacked_layers

B, T = 2, 13  # T not a multiple of the KDA chunk (16)


def _config(scan: bool = False, mode: str = "attnres"):
  """KDA and MLA layers, dense and MoE FFNs; with `scan`, layers 2-5 run as a scan of two periods."""
  c = base_config()
  c.data.vocab_size = 300
  m = c.model
  m.update(num_layers=6, layer_pattern="KM", num_dense_layers=1, d_model=32, scan_layers=scan)
  m.kda.update(num_heads=2, head_k_dim=16, head_v_dim=16, gate_rank=8, chunk_size=16, implementation="xla",
               conv_implementation="xla")
  m.mla.update(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
               attention="xla")
  m.attnres.update(mode=mode, block_size=4)
  m.ffn.hidden_dim = 48
  m.moe.update(num_experts=4, top_k=2, shared_hidden_dim=32, latent_dim=16, expert_hidden_dim=16,
               grouped_matmul="xla", balance_implementation="xla")
  return c


def _variables(model, tokens):
  variables = jax.jit(model.init)(jax.random.key(1), tokens)
  return {k: nn.unbox(variables[k]) for k in ("params", "balance")}


def _jitted(model):
  """model.apply(variables, tokens, cache=cache), jitted once per model: each call shape compiles once."""
  return jax.jit(lambda v, t, c: model.apply(v, t, cache=c))


def _decoded(apply, variables, tokens, cache, prefill: int):
  """Hidden states of `tokens` fed as a prefill of `prefill` tokens, then one token at a time."""
  outs = []
  bounds = [0] + ([prefill] if prefill else []) + list(range(prefill + 1, tokens.shape[1] + 1))
  for a, b in zip(bounds[:-1], bounds[1:], strict=True):
    h, cache = apply(variables, tokens[:, a:b], cache)
    outs.append(h)
  return jnp.concatenate(outs, axis=1), cache


@pytest.fixture(scope="module")
def unrolled():
  """(model, variables, jitted apply) of the unrolled AttnRes model, shared by the tests below."""
  model = build_model(_config())
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (B, T)), jnp.int32)
  return model, _variables(model, tokens), _jitted(model)


@pytest.mark.parametrize("scan,mode,prefill",
                         [(False, "attnres", 0), (True, "residual", 5)])
def test_model_decode_matches_the_whole_row(unrolled, scan, mode, prefill):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (B, T)), jnp.int32)
  if (scan, mode) == (False, "attnres"):
    model, variables, apply = unrolled
  else:
    config = _config(scan=scan, mode=mode)
    model = build_model(config)
    variables = _variables(build_model(_config(mode=mode)), tokens)
    if scan:  # the same weights, stacked as the scanned model keeps them
      variables = {k: stacked_layers(v, config.model) for k, v in variables.items()}
    apply = _jitted(model)
  whole, none = apply(variables, tokens, None)
  assert none is None
  cache = init_cache(model.cfg, B, max_len=T + 3)
  decoded, cache = _decoded(apply, variables, tokens, cache, prefill)
  np.testing.assert_allclose(np.asarray(decoded), np.asarray(whole), rtol=2e-4, atol=2e-4)
  # The caches came back with the structure they went in with, advanced by the row.
  assert jax.tree.structure(cache) == jax.tree.structure(init_cache(model.cfg, B, max_len=T + 3))
  mla_index = [x for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]
               if getattr(path[-1], "key", None) == "length"]
  assert mla_index and all(np.all(np.asarray(i) == T) for i in mla_index)


def test_model_refuses_a_cache_with_packed_documents(unrolled):
  model, variables, _ = unrolled
  tokens = jnp.zeros((B, 4), jnp.int32)
  with pytest.raises(ValueError, match="one document a row"):
    model.apply(variables, tokens, jnp.zeros((B, 4), jnp.int32), cache=init_cache(model.cfg, B, 8))


def test_embeddings_in_place_of_tokens(unrolled):
  """`embed` then `embeddings_BTD` is the token path; a soft embedding placed into the row moves the
  outputs from its position on, and not before it (causality)."""
  model, variables, apply = unrolled
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 300, (B, T)), jnp.int32)
  h_tokens, _ = apply(variables, tokens, None)
  x = model.apply(variables, tokens, method=model.embed)
  forward = jax.jit(lambda v, x: model.apply(v, embeddings_BTD=x)[0])
  np.testing.assert_allclose(np.asarray(forward(variables, x)), np.asarray(h_tokens), rtol=1e-6, atol=1e-6)
  soft = x.at[:, 6].set(jax.random.normal(jax.random.key(2), x.shape[::2]))
  h_soft = forward(variables, soft)
  np.testing.assert_allclose(np.asarray(h_soft[:, :6]), np.asarray(h_tokens[:, :6]), rtol=1e-6, atol=1e-6)
  assert float(jnp.max(jnp.abs(h_soft[:, 6:] - h_tokens[:, 6:]))) > 1e-3
  with pytest.raises(ValueError, match="exactly one"):
    model.apply(variables, tokens, embeddings_BTD=x)
  with pytest.raises(ValueError, match="exactly one"):
    model.apply(variables)


_KDA_CFG = _config().model
_KDA = KDA(ml_collections.FrozenConfigDict(_KDA_CFG))
_LENGTH = 21  # not a multiple of the chunk (16)
_KDA_APPLY = jax.jit(lambda p, x, packing, cache: _KDA.apply(p, x, packing, cache=cache))


@settings(deadline=None, max_examples=5)
@given(split=st.sampled_from([5, 16, 17]), lengths=st.lists(st.integers(1, 8), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_kda_layer_continues_from_its_cache(split, lengths, seed):
  """A packed row run in two calls, the second continuing from the first's cache, equals the row in
  one call, at a split inside a chunk or on its edge, documents crossing it or not."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((1, _LENGTH, _KDA_CFG.d_model)), jnp.float32)
  seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(_LENGTH, len(lengths))])
  seg = jnp.asarray(seg[:_LENGTH][None], jnp.int32)
  params = _KDA_PARAMS
  # Document ids must be comparable across the two calls: the row's own Packing, cut in two, not each
  # piece's segment ids worked out again from its start.
  doc = Packing.of(seg, 1, _LENGTH).document_ids_BT
  whole, none = _KDA_APPLY(params, x, Packing(doc), None)
  assert none is None
  first, cache = _KDA_APPLY(params, x[:, :split], Packing(doc[:, :split]), init_kda_cache(_KDA.cfg, 1))
  second, _ = _KDA_APPLY(params, x[:, split:], Packing(doc[:, split:]), cache)
  np.testing.assert_allclose(np.asarray(jnp.concatenate([first, second], axis=1)), np.asarray(whole),
                             rtol=2e-4, atol=2e-5)


_KDA_PARAMS = jax.jit(_KDA.init)(jax.random.key(3), jnp.zeros((1, _LENGTH, _KDA_CFG.d_model)))


@settings(deadline=None, max_examples=4)
@given(lengths=st.lists(st.integers(0, 20), min_size=3, max_size=3), before=st.integers(0, 5),
       seed=st.integers(0, 2**16))
def test_kda_pads_reach_no_state(lengths, before, seed):
  """Rows of 0 to 20 real tokens padded to 20 and appended together leave each row's carry as
  appending its real tokens alone does, and give the same outputs at the real positions; across a
  chunk edge (16), after a first piece of `before` tokens or none."""
  rng = np.random.default_rng(seed)
  B, T = 3, 20
  x = jnp.asarray(rng.standard_normal((B, before + T, _KDA_CFG.d_model)), jnp.float32)
  apply = jax.jit(lambda x, n, cache: _KDA.apply(_KDA_PARAMS, x, Appended(n), cache=cache))
  cache = init_kda_cache(_KDA.cfg, B)
  if before:
    _, cache = apply(x[:, :before], jnp.full((B,), before, jnp.int32), cache)
  y, padded = apply(x[:, before:], jnp.asarray(lengths, jnp.int32), cache)
  for b, n in enumerate(lengths):
    row = jax.tree.map(lambda a, b=b: a[b:b + 1], cache)
    if n:
      y_alone, alone = _KDA_APPLY(_KDA_PARAMS, x[b:b + 1, before:before + n], None, row)
      np.testing.assert_allclose(np.asarray(y[b, :n]), np.asarray(y_alone[0]), rtol=1e-4, atol=1e-5)
    else:
      alone = row
    chex.assert_trees_all_close(jax.tree.map(lambda a, b=b: a[b:b + 1], padded), alone, rtol=1e-4, atol=1e-5)


def test_mla_pads_write_nothing():
  """An MLA cache appended rows of 2, 0 and 5 real tokens (padded to 5) holds what appending each
  row's real tokens alone writes, and nothing past them."""
  cfg = _config().model
  layer = GatedMLA(ml_collections.FrozenConfigDict(cfg))
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 8, cfg.d_model)), jnp.float32)
  params = layer.init(jax.random.key(0), x)
  apply = jax.jit(lambda x, n, cache: layer.apply(params, x, Appended(n), cache=cache))
  cache = init_mla_cache(layer.cfg, 3, 12)
  _, cache = apply(x[:, :3], jnp.full((3,), 3, jnp.int32), cache)
  y, padded = apply(x[:, 3:], jnp.asarray([2, 0, 5], jnp.int32), cache)
  np.testing.assert_array_equal(np.asarray(padded["length"]), [5, 3, 8])
  for b, n in enumerate([2, 0, 5]):
    row = jax.tree.map(lambda a, b=b: a[b:b + 1], cache)
    if n:
      y_alone, alone = layer.apply(params, x[b:b + 1, 3:3 + n], cache=row)
      np.testing.assert_allclose(np.asarray(y[b, :n]), np.asarray(y_alone[0]), rtol=1e-5, atol=1e-5)
    else:
      alone = row
    np.testing.assert_allclose(np.asarray(padded["latent"][b]), np.asarray(alone["latent"][0]), atol=1e-6)
    assert not np.any(np.asarray(padded["latent"][b, 3 + n:]))  # nothing written past the real tokens
