"""Gated MLA (NoPE): causality, packed documents, position independence, the gate, decode, and an
independent float64 NumPy reference of the whole layer (plus a float32 jnp twin for gradients)."""

import chex
import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from references import doc_index

from moejax.config import base_config, validate
from moejax.layers.mla import GatedMLA, init_mla_cache, kernel_init


def make_cfg(dtype="float32", **mla):
  c = base_config()
  c.model.dtype = dtype
  for name, value in mla.items():
    c.model.mla[name] = value
  return ml_collections.FrozenConfigDict(validate(c).model)


def random_params(layer, x, seed):
  """Random params of the layer's shapes, drawn in NumPy: fan-in scaled kernels, norm scales near one.

  Avoids compiling a threefry draw per parameter (seconds on a small CPU) in every test; the real
  initialiser is tested once in test_kernel_init_is_fan_in_over_input_axes.
  """
  rng = np.random.default_rng(seed)
  shapes = nn.meta.unbox(jax.eval_shape(layer.init, jax.random.key(0), x))["params"]

  def draw(path, s):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      return jnp.asarray(1.0 + 0.2 * rng.standard_normal(s.shape), jnp.float32)
    fan_in = np.prod(s.shape[:2]) if "w_o" in name else s.shape[0]
    return jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(fan_in), jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def setup_layer(cfg, B=2, T=8, seed=0):
  layer = GatedMLA(cfg)
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, cfg.d_model)), jnp.float32)
  return layer, random_params(layer, x, seed + 1), x


def reference(params, x, seg, cfg, xp=np):
  """The layer written out naively in namespace xp; returns (y, ungated attention output)."""
  a = cfg.mla

  def rms(z, scale):
    return z / xp.sqrt(xp.mean(z * z, axis=-1, keepdims=True) + cfg.norm_eps) * scale

  p = params
  cq = rms(xp.einsum("btd,dq->btq", x, p["w_dq"]), p["q_norm"]["scale"])
  q = xp.einsum("btq,qhk->bthk", cq, p["w_uq"])
  c = rms(xp.einsum("btd,dc->btc", x, p["w_dkv"]), p["kv_norm"]["scale"])
  k = xp.einsum("btc,chk->bthk", c, p["w_uk"])
  v = xp.einsum("btc,chv->bthv", c, p["w_uv"])
  T = x.shape[1]
  doc = doc_index(seg if seg is not None else np.zeros(x.shape[:2], np.int32))
  logits = xp.einsum("bthk,bshk->bhts", q, k)
  R = a.rope_head_dim
  if R:  # decoupled RoPE: rotated query dims per head, one rotated key shared by the heads
    pos = np.stack([np.arange(T) - np.searchsorted(d, d) for d in doc])  # position within the document
    angle = pos[..., None] * a.rope_theta ** (-np.arange(0, R, 2) / R)  # [B,T,R/2]

    def rot(z, angle):
      c, s = xp.cos(angle), xp.sin(angle)
      z1, z2 = z[..., :R // 2], z[..., R // 2:]
      return xp.concatenate([z1 * c - z2 * s, z1 * s + z2 * c], axis=-1)

    qr = rot(xp.einsum("btq,qhr->bthr", cq, p["w_qr"]), angle[:, :, None])
    kr = rot(xp.einsum("btd,dr->btr", x, p["w_kr"]), angle)
    logits = logits + xp.einsum("bthr,bsr->bhts", qr, kr)
  logits = logits * (a.qk_nope_head_dim + R) ** -0.5
  allowed = np.tril(np.ones((T, T), bool))[None, None] & (doc[:, None, :, None] == doc[:, None, None, :])
  logits = xp.where(allowed, logits, -np.inf)
  e = xp.exp(logits - xp.max(logits, axis=-1, keepdims=True))
  attn = xp.einsum("bhts,bshv->bthv", e / xp.sum(e, axis=-1, keepdims=True), v)
  gate = 1.0 / (1.0 + xp.exp(-xp.einsum("btd,dhv->bthv", x, p["w_g"])))
  return xp.einsum("bthv,hvd->btd", gate * attn, p["w_o"]), attn


def to64(tree):
  return jax.tree.map(lambda t: np.asarray(t, np.float64), tree)


def test_param_shapes_and_logical_axes():
  cfg = make_cfg(qk_nope_head_dim=8, v_head_dim=12)
  layer = GatedMLA(cfg)
  boxed = jax.eval_shape(layer.init, jax.random.key(0), jnp.zeros((1, 4, cfg.d_model)))
  specs = nn.get_partition_spec(boxed)["params"]
  shapes = jax.tree.map(lambda t: t.shape, nn.meta.unbox(boxed)["params"])
  D, H, Q, C = 64, 4, 32, 16
  expected = {
      "w_dq": ((D, Q), P("embed", "q_lora")),
      "w_uq": ((Q, H, 8), P("q_lora", "heads", "kv")),
      "w_dkv": ((D, C), P("embed", "kv_lora")),
      "w_uk": ((C, H, 8), P("kv_lora", "heads", "kv")),
      "w_uv": ((C, H, 12), P("kv_lora", "heads", "kv")),
      "w_g": ((D, H, 12), P("embed", "heads", "kv")),
      "w_o": ((H, 12, D), P("heads", "kv", "embed")),
  }
  for name, (shape, spec) in expected.items():
    assert shapes[name] == shape, name
    assert specs[name] == spec, name
  for norm, width in (("q_norm", Q), ("kv_norm", C)):
    assert shapes[norm]["scale"] == (width,)
    assert specs[norm]["scale"] == P("norm")
  assert set(shapes) == set(expected) | {"q_norm", "kv_norm"}


def test_kernel_init_is_fan_in_over_input_axes():
  # [in, heads, dim] and [heads, dim, out] kernels, as used by w_uq and w_o
  draw = jax.jit(lambda k: (kernel_init(1, 3)(k, (256, 4, 16)), kernel_init(2, 3)(k, (4, 16, 64))))
  w_in, w_out = draw(jax.random.key(0))
  np.testing.assert_allclose(np.std(np.asarray(w_in)), 256 ** -0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(np.asarray(w_out)), 64 ** -0.5, rtol=0.05)


WIDE = make_cfg(qk_nope_head_dim=8, v_head_dim=12)
WIDE_LAYER, WIDE_PARAMS, WIDE_X = setup_layer(WIDE, B=2, T=10)
WIDE_APPLY = jax.jit(lambda *args: WIDE_LAYER.apply(*args)[0])


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(ids=st.lists(st.integers(0, 2), min_size=10, max_size=10))
def test_matches_float64_reference(ids):
  # few distinct ids changing at random places: equal ids also recur in separate documents
  seg = np.array([ids, ids[::-1]], np.int32)
  y = WIDE_APPLY({"params": WIDE_PARAMS}, WIDE_X, jnp.asarray(seg))
  y_ref, _ = reference(to64(WIDE_PARAMS), np.asarray(WIDE_X, np.float64), seg, WIDE)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-5)


BASE = make_cfg()
BASE_LAYER, BASE_PARAMS, BASE_X = setup_layer(BASE, B=2, T=11)
BASE_APPLY = jax.jit(lambda p, x, seg=None: BASE_LAYER.apply({"params": p}, x, seg)[0])


def test_gradients_match_reference():
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 5, 5, 5], [4] * 6 + [2] * 5], np.int32)
  r = jnp.asarray(np.random.default_rng(7).standard_normal(BASE_X.shape), jnp.float32)
  loss = lambda p, x: jnp.sum(BASE_LAYER.apply({"params": p}, x, jnp.asarray(seg))[0] * r)
  loss_ref = lambda p, x: jnp.sum(reference(p, x, seg, BASE, xp=jnp)[0] * r)
  both = jax.jit(lambda p, x: (jax.grad(loss, (0, 1))(p, x), jax.grad(loss_ref, (0, 1))(p, x)))
  g, g_ref = both(BASE_PARAMS, BASE_X)
  chex.assert_trees_all_close(g, g_ref, rtol=2e-4, atol=2e-5)


def test_causal_outputs_and_gradients():
  y = BASE_APPLY(BASE_PARAMS, BASE_X)
  t = 6
  y2 = BASE_APPLY(BASE_PARAMS, BASE_X.at[:, t].add(3.0))
  np.testing.assert_array_equal(np.asarray(y2[:, :t]), np.asarray(y[:, :t]))
  assert not np.allclose(y2[:, t:], y[:, t:])
  # d y[b, s] / d x[b', t]: zero whenever t > s, nonzero on the diagonal
  jac = jax.jit(jax.jacrev(lambda x: BASE_APPLY(BASE_PARAMS, x).sum(-1)))(BASE_X)
  jac = np.abs(np.asarray(jac)).sum(-1)  # [B, T, B, T]
  T = BASE_X.shape[1]
  for b in range(BASE_X.shape[0]):
    assert np.all(jac[b, :, b][np.triu_indices(T, 1)] == 0)
    assert np.all(np.diag(jac[b, :, b]) > 0)


def test_packed_row_equals_separate_documents():
  lengths = (4, 2, 5)
  # ids 7, 3, 7: the third document must not see the first although their ids are equal
  seg = jnp.asarray([np.repeat([7, 3, 7], lengths)] * 2, jnp.int32)
  y = BASE_APPLY(BASE_PARAMS, BASE_X, seg)
  starts = np.cumsum((0,) + lengths)
  # Each document alone: at the start of its own row, where causality (tested above) keeps the
  # trailing zeros out of its outputs; no segment ids involved.
  alone = jnp.stack([jnp.pad(BASE_X[0, a:b], ((0, BASE_X.shape[1] - (b - a)), (0, 0)))
                     for a, b in zip(starts[:-1], starts[1:], strict=True)])
  y_alone = jax.jit(BASE_LAYER.apply)({"params": BASE_PARAMS}, alone)[0]
  for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
    np.testing.assert_allclose(np.asarray(y[0, a:b]), np.asarray(y_alone[i, :b - a]), rtol=1e-5,
                               atol=1e-6)


def test_nope_shift_invariance():
  doc, filler = BASE_X[0, :5], BASE_X[0, 5:]
  rows = jnp.stack([jnp.concatenate([doc, filler]), jnp.concatenate([filler, doc])])
  seg = jnp.asarray([[0] * 5 + [1] * 6, [0] * 6 + [1] * 5], jnp.int32)
  y = BASE_APPLY(BASE_PARAMS, rows, seg)
  np.testing.assert_allclose(np.asarray(y[0, :5]), np.asarray(y[1, 6:]), rtol=1e-5, atol=1e-6)


def test_gate_zero_kernel_halves_attention():
  params = dict(BASE_PARAMS, w_g=jnp.zeros_like(BASE_PARAMS["w_g"]))
  y = BASE_APPLY(params, BASE_X)
  _, attn = reference(to64(params), np.asarray(BASE_X, np.float64), None, BASE)
  expected = np.einsum("bthv,hvd->btd", 0.5 * attn, np.asarray(params["w_o"], np.float64))
  np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)


def test_bfloat16_runs_finite_and_close():
  layer16 = GatedMLA(make_cfg(dtype="bfloat16"))
  seg = np.array([[0] * 6 + [1] * 5, [0] * 11], np.int32)

  def run(p):
    y, vjp = jax.vjp(lambda p: layer16.apply({"params": p}, BASE_X, jnp.asarray(seg))[0], p)
    return y, vjp(jnp.ones_like(y))[0]

  y16, g = jax.jit(run)(BASE_PARAMS)
  assert y16.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(y16, np.float32)))
  assert all(np.all(np.isfinite(np.asarray(l, np.float32))) for l in jax.tree.leaves(g))
  y_ref, _ = reference(to64(BASE_PARAMS), np.asarray(BASE_X, np.float64), seg, BASE)
  np.testing.assert_allclose(np.asarray(y16, np.float32), y_ref, rtol=0.05, atol=0.03)


@pytest.mark.parametrize("prefill", [0, 3])
def test_decode_matches_training_path(prefill):
  cfg, layer, params, x = WIDE, WIDE_LAYER, WIDE_PARAMS, WIDE_X
  y = WIDE_APPLY({"params": params}, x)
  step = jax.jit(lambda x, cache: layer.apply({"params": params}, x, cache, method="decode"))
  cache = init_mla_cache(cfg, batch=2, max_len=12)
  outs = []
  if prefill:
    out, cache = step(x[:, :prefill], cache)
    outs.append(out)
  for t in range(prefill, x.shape[1]):
    out, cache = step(x[:, t:t + 1], cache)
    outs.append(out)
  assert np.all(np.asarray(cache["length"]) == x.shape[1])
  assert cache["latent"].shape == (2, 12, cfg.mla.kv_lora_rank)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(y), rtol=1e-5,
                             atol=1e-5)


def test_rope_matches_float64_reference_on_packed_rows():
  """Decoupled RoPE (an ablation of the NoPE design): positions restart in every document."""
  cfg = make_cfg(rope_head_dim=8, rope_theta=100.0)
  layer, params, x = setup_layer(cfg, B=2, T=11, seed=4)
  seg = np.array([[0] * 4 + [1] * 7, [5] * 11], np.int32)
  y = jax.jit(lambda p, x, s: layer.apply({"params": p}, x, s)[0])(params, x, jnp.asarray(seg))
  want, _ = reference(to64(params), np.asarray(x, np.float64), seg, cfg)
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
  # Unlike NoPE, a document's outputs depend on its tokens' order only through relative positions:
  # the same document at the start of a row and after another one gives the same outputs.
  y_alone = jax.jit(lambda p, x: layer.apply({"params": p}, x)[0])(params, x[:, 4:])
  np.testing.assert_allclose(np.asarray(y[0, 4:]), np.asarray(y_alone[0]), rtol=1e-5, atol=1e-6)


def test_rope_decode_matches_training_path():
  cfg = make_cfg(rope_head_dim=4)
  layer, params, x = setup_layer(cfg, B=2, T=9, seed=6)
  y = jax.jit(lambda p, x: layer.apply({"params": p}, x)[0])(params, x)
  step = jax.jit(lambda x, cache: layer.apply({"params": params}, x, cache, method="decode"))
  cache = init_mla_cache(cfg, batch=2, max_len=16)
  assert cache["latent"].shape == (2, 16, cfg.mla.kv_lora_rank + 4)
  outs = []
  # a piece at the start of the rows, a piece over the cache, then single steps
  for a, b in ((0, 5), (5, 7), (7, 8), (8, 9)):
    out, cache = step(x[:, a:b], cache)
    outs.append(out)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(y), rtol=1e-5, atol=1e-5)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(i=st.integers(0, 5000), j=st.integers(0, 5000), shift=st.integers(-3000, 3000),
                  seed=st.integers(0, 1000))
def test_rotary_logits_depend_on_relative_position_only(i, j, shift, seed):
  from moejax.layers.mla import rotate

  rng = np.random.default_rng(seed)
  q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32) for _ in range(2))
  at = lambda z, p: rotate(z, jnp.full((1, 1), p, jnp.int32), 10000.0)[0, 0, 0]
  shift = max(shift, -min(i, j))
  a = float(jnp.dot(at(q, i), at(k, j)))
  b = float(jnp.dot(at(q, i + shift), at(k, j + shift)))
  np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


def test_decode_rejects_cache_overflow():
  cache = init_mla_cache(BASE, batch=2, max_len=10)
  with pytest.raises(ValueError, match="overflows"):
    BASE_LAYER.apply({"params": BASE_PARAMS}, BASE_X, cache, method="decode")


def test_decode_past_the_cache_under_jit_gives_nan():
  """Under jit the index is traced, so the overflow cannot raise: the outputs say it instead."""
  cache = init_mla_cache(BASE, batch=2, max_len=14)
  decode = jax.jit(lambda x, c: BASE_LAYER.apply({"params": BASE_PARAMS}, x, c, method="decode"))
  y, cache = decode(BASE_X, cache)  # 11 of 14
  assert bool(jnp.all(jnp.isfinite(y)))
  y, cache = decode(BASE_X[:, :3], cache)  # 14 of 14: fits exactly
  assert bool(jnp.all(jnp.isfinite(y)))
  y, _ = decode(BASE_X[:, :1], cache)
  assert bool(jnp.all(jnp.isnan(y)))


def test_bad_inputs_raise():
  layer, params, x = BASE_LAYER, BASE_PARAMS, BASE_X
  with pytest.raises(ValueError, match="D=64"):
    layer.apply({"params": params}, x[..., :32])
  with pytest.raises(ValueError, match="segment_ids must have shape"):
    layer.apply({"params": params}, x, jnp.zeros((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="integer"):
    layer.apply({"params": params}, x, jnp.zeros((2, 11), jnp.float32))
  with pytest.raises(ValueError, match="attention_impl"):
    GatedMLA(BASE, attention_impl="flash").apply({"params": params}, x)


@pytest.mark.parametrize("T", [11, 130])
def test_pallas_document_attention_matches_reference(T):
  """The Pallas document-attention kernels (interpret mode; `model.mla.attention="pallas"` on GPU) vs
  the float64 reference on packed rows of a length that is not a multiple of its tiles, with gradients."""
  cfg = make_cfg(attention="interpret")
  layer, params, x = setup_layer(cfg, B=2, T=T, seed=3)
  rng = np.random.default_rng(4)
  seg = np.sort(rng.integers(0, 4, size=(2, T)), axis=1).astype(np.int32)
  y = jax.jit(lambda p, x, s: layer.apply({"params": p}, x, s)[0])(params, x, jnp.asarray(seg))
  y_ref, _ = reference(to64(params), np.asarray(x, np.float64), seg, cfg)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-4, atol=1e-5)
  r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x, jnp.asarray(seg))[0] * r)
  loss_ref = lambda p, x: jnp.sum(reference(p, x, seg, cfg, xp=jnp)[0] * r)
  g, g_ref = jax.jit(lambda p, x: (jax.grad(loss, (0, 1))(p, x), jax.grad(loss_ref, (0, 1))(p, x)))(params, x)
  chex.assert_trees_all_close(g, g_ref, rtol=2e-4, atol=2e-5)
  y_one = jax.jit(lambda p, x: layer.apply({"params": p}, x)[0])(params, x)  # no segments: one document
  y_one_ref, _ = reference(to64(params), np.asarray(x, np.float64), None, cfg)
  np.testing.assert_allclose(np.asarray(y_one), y_one_ref, rtol=1e-4, atol=1e-5)


def test_attention_choice():
  layer = GatedMLA(make_cfg("bfloat16"))
  on_gpu = jax.default_backend() == "gpu"
  assert layer.implementation(packed=True) == ("pallas" if on_gpu else "xla")
  assert layer.implementation(packed=False) == ("cudnn" if on_gpu else "xla")
  assert GatedMLA(make_cfg()).implementation(packed=True) == "xla"  # float32
  assert GatedMLA(make_cfg(attention="interpret")).implementation(packed=False) == "interpret"
  if not on_gpu:
    with pytest.raises(ValueError, match="needs a GPU backend"):
      GatedMLA(make_cfg(attention="pallas")).apply({"params": BASE_PARAMS}, BASE_X)


@hypothesis.settings(deadline=None, max_examples=6)
@hypothesis.given(S=st.integers(1, 5), L=st.integers(5, 40), max_block=st.sampled_from([4, 7, 64]),
                  seed=st.integers(0, 2**16))
def test_latent_attention_is_softmax_over_the_visible_cache(S, L, max_block, seed):
  """The blockwise recurrence, with blocks that tile L unevenly (the last one starting early), equals
  a plain float64 softmax over each query's visible positions l <= pos."""
  import moejax.layers.mla as mla_module

  rng = np.random.default_rng(seed)
  B, H, C = 2, 3, 8
  q = rng.standard_normal((B, S, H, C)).astype(np.float32)
  latent = rng.standard_normal((B, L, C)).astype(np.float32)
  pos = np.stack([rng.integers(0, L, S), rng.integers(0, L, S)]).astype(np.int32)
  old = mla_module._MAX_BLOCK
  mla_module._MAX_BLOCK = max_block
  try:
    got = np.asarray(mla_module.latent_attention(jnp.asarray(q), jnp.asarray(latent), jnp.asarray(pos), 0.3))
  finally:
    mla_module._MAX_BLOCK = old
  scores = np.einsum("bshc,blc->bhsl", q.astype(np.float64), latent.astype(np.float64)) * 0.3
  scores = np.where((np.arange(L)[None, None, :] <= pos[:, :, None])[:, None], scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bhsl,blc->bshc", p / p.sum(-1, keepdims=True), latent.astype(np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
