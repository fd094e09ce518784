"""KDA mixer layer: a float64 NumPy reference of the whole layer (token-by-token delta rule), the
document-restarting short conv, causality, packed documents, the gate bound, and recurrent == xla."""

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
from moejax.layers.kda import KDA, a_log_init, bounded_decay, check_lower_bound
from pallas_kernels.segments import document_ids
from pallas_kernels.short_conv import short_conv

B, T = 2, 24  # chunk_size 16 below: two chunks, one partial, so the state crosses a chunk boundary


def make_cfg(dtype="float32", implementation="xla", **kda):
  c = base_config()
  c.model.dtype = dtype
  c.model.kda.chunk_size = 16
  c.model.kda.head_k_dim = 8
  c.model.kda.head_v_dim = 12
  c.model.kda.gate_rank = 8
  c.model.kda.implementation = implementation
  for name, value in kda.items():
    c.model.kda[name] = value
  return ml_collections.FrozenConfigDict(validate(c).model)


def random_params(layer, x, seed):
  """Random params of the layer's shapes drawn in NumPy (no threefry compile per parameter).

  Scales are chosen so every path matters: gates spread over (lb, 0), norm scales away from one.
  """
  rng = np.random.default_rng(seed)
  shapes = nn.meta.unbox(jax.eval_shape(layer.init, jax.random.key(0), x))["params"]

  def draw(path, s):
    name = jax.tree_util.keystr(path)
    n = rng.standard_normal(s.shape)
    if "A_log" in name:
      v = np.log(rng.uniform(1.0, 16.0, s.shape))
    elif "dt_bias" in name or "gate_bias" in name:
      v = 0.3 * n
    elif "norm_scale" in name:
      v = 1.0 + 0.2 * n
    elif "conv" in name:
      v = 0.5 * n
    else:
      v = n / np.sqrt(np.prod(s.shape[:2]) if "w_o" in name else s.shape[0])
    return jnp.asarray(v, jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def conv_reference(x, w, doc):
  """Naive causal depthwise conv, tap j on x[t - (W-1) + j], skipping taps in another document."""
  W = w.shape[0]
  y = np.zeros(x.shape, np.float64)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      for j in range(W):
        src = t - (W - 1) + j
        if src >= 0 and doc[b, src] == doc[b, t]:
          y[b, t] += w[j] * x[b, src]
  return y


def reference(p, x, seg, cfg):
  """The KDA layer in float64 NumPy with the delta rule run token by token."""
  kc, eps = cfg.kda, cfg.norm_eps
  p = jax.tree.map(lambda t: np.asarray(t, np.float64), p)
  x = np.asarray(x, np.float64)
  doc = doc_index(seg if seg is not None else np.zeros(x.shape[:2], np.int32))
  sigmoid = lambda u: 1.0 / (1.0 + np.exp(-u))
  silu = lambda u: u * sigmoid(u)
  l2 = lambda u: u / np.sqrt(np.sum(u * u, -1, keepdims=True) + eps)
  branch = lambda n: silu(conv_reference(np.einsum("btd,dhk->bthk", x, p[f"w_{n}"]), p[f"conv_{n}"], doc))
  q, k, v = l2(branch("q")), l2(branch("k")), branch("v")
  beta = sigmoid(np.einsum("btd,dh->bth", x, p["w_beta"]))
  z = np.einsum("btr,rhk->bthk", x @ p["w_decay_a"], p["w_decay_b"])
  g = kc.gate_lower_bound * sigmoid(np.exp(p["A_log"])[:, None] * (z + p["dt_bias"]))
  Bn, Tn, H, K = q.shape
  o = np.zeros((Bn, Tn, H, v.shape[-1]))
  for b in range(Bn):
    for h in range(H):
      S = np.zeros((K, v.shape[-1]))
      for t in range(Tn):
        if t > 0 and doc[b, t] != doc[b, t - 1]:
          S = np.zeros_like(S)
        kt, bt = k[b, t, h], beta[b, t, h]
        S = np.exp(g[b, t, h])[:, None] * S
        S = S - bt * np.outer(kt, kt @ S) + bt * np.outer(kt, v[b, t, h])
        o[b, t, h] = K ** -0.5 * S.T @ q[b, t, h]
  o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * p["o_norm_scale"]
  u = np.einsum("btr,rhv->bthv", x @ p["w_gate_a"], p["w_gate_b"]) + p["gate_bias"]
  return np.einsum("bthv,hvd->btd", o * sigmoid(u), p["w_o"])


CFG = make_cfg()
LAYER = KDA(CFG)
X = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, CFG.d_model)), jnp.float32)
PARAMS = random_params(LAYER, X, 1)
# Returns (y, sown intermediates); one compiled function shared by several tests.
# (y, intermediates): the layer's cache output is None without a cache.
APPLY = jax.jit(lambda p, x, seg=None: (lambda out, inter: (out[0], inter))(
    *LAYER.apply({"params": p}, x, seg, mutable=["intermediates"])))
SEG = np.array([[3] * 5 + [1] * 13 + [3] * 6, [0] * 20 + [2] * 4], np.int32)


def test_param_shapes_and_logical_axes():
  boxed = jax.eval_shape(LAYER.init, jax.random.key(0), X)
  specs = nn.get_partition_spec(boxed)["params"]
  shapes = jax.tree.map(lambda t: t.shape, nn.meta.unbox(boxed)["params"])
  D, H, K, V, R, W = 64, 4, 8, 12, 8, 4
  expected = {
      "w_q": ((D, H, K), P("embed", "heads", "kv")),
      "w_k": ((D, H, K), P("embed", "heads", "kv")),
      "w_v": ((D, H, V), P("embed", "heads", "kv")),
      "conv_q": ((W, H, K), P("conv", "heads", "kv")),
      "conv_k": ((W, H, K), P("conv", "heads", "kv")),
      "conv_v": ((W, H, V), P("conv", "heads", "kv")),
      "w_beta": ((D, H), P("embed", "heads")),
      "w_decay_a": ((D, R), P("embed", "rank")),
      "w_decay_b": ((R, H, K), P("rank", "heads", "kv")),
      "A_log": ((H,), P("heads")),
      "dt_bias": ((H, K), P("heads", "kv")),
      "o_norm_scale": ((V,), P("norm")),
      "w_gate_a": ((D, R), P("embed", "rank")),
      "w_gate_b": ((R, H, V), P("rank", "heads", "kv")),
      "gate_bias": ((H, V), P("heads", "kv")),
      "w_o": ((H, V, D), P("heads", "kv", "embed")),
  }
  assert set(shapes) == set(expected)
  for name, (shape, spec) in expected.items():
    assert shapes[name] == shape, name
    assert specs[name] == spec, name


def test_a_log_init_range():
  a = np.exp(np.asarray(jax.jit(lambda k: a_log_init(k, (4096,)))(jax.random.key(3))))
  assert np.all((a >= 1.0) & (a <= 16.0))
  assert a.min() < 1.1 and a.max() > 15.0  # uniform over the whole range, not a point


CONV = jax.jit(short_conv)


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(ids=st.lists(st.integers(0, 2), min_size=9, max_size=9))
def test_short_conv_matches_numpy(ids):
  rng = np.random.default_rng(len(ids))
  x = rng.standard_normal((2, 9, 3, 5)).astype(np.float32)
  w = rng.standard_normal((4, 3, 5)).astype(np.float32)
  seg = np.array([ids, ids[::-1]], np.int32)
  y = CONV(x, w, document_ids(jnp.asarray(seg)))
  np.testing.assert_allclose(np.asarray(y), conv_reference(x, w, doc_index(seg)), rtol=1e-5, atol=1e-5)


def test_short_conv_without_segments_and_short_rows():
  rng = np.random.default_rng(1)
  for length in (2, 9):  # fewer tokens than taps, and more
    x = rng.standard_normal((1, length, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(short_conv(x, w)),
                               conv_reference(x, w, np.zeros((1, length), int)), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="channels"):
    short_conv(x, rng.standard_normal((4, 2)))


@pytest.mark.parametrize("implementation", ["xla", "recurrent"])
def test_matches_float64_reference(implementation):
  layer = KDA(make_cfg(implementation=implementation))
  y = jax.jit(layer.apply)({"params": PARAMS}, X, jnp.asarray(SEG))[0]
  np.testing.assert_allclose(np.asarray(y), reference(PARAMS, X, SEG, CFG), rtol=2e-4, atol=2e-5)


def test_recurrent_equals_xla_with_gradients():
  r = jnp.asarray(np.random.default_rng(5).standard_normal(X.shape), jnp.float32)

  def grads(implementation):
    layer = KDA(make_cfg(implementation=implementation))
    loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x, jnp.asarray(SEG))[0] * r)
    return jax.value_and_grad(loss, (0, 1))(PARAMS, X)

  both = jax.jit(lambda: (grads("xla"), grads("recurrent")))()
  # two float32 algorithms: compare each leaf relative to its own scale
  flat_b = jax.tree.leaves(both[1])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(both[0]), flat_b, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)), path
    assert np.max(np.abs(a - b)) <= 2e-5 * np.max(np.abs(b)) + 1e-6, jax.tree_util.keystr(path)


def test_causal():
  y = APPLY(PARAMS, X, jnp.asarray(SEG))[0]
  for t in (3, 17):
    y2 = APPLY(PARAMS, X.at[:, t].add(3.0), jnp.asarray(SEG))[0]
    np.testing.assert_allclose(np.asarray(y2[:, :t]), np.asarray(y[:, :t]), rtol=1e-6, atol=1e-6)
    assert not np.allclose(y2[:, t], y[:, t])


def test_packed_row_equals_separate_documents():
  lengths = (5, 13, 6)
  # ids 3, 1, 3: the third document must not see the first, through the conv or the state
  seg = jnp.asarray([np.repeat([3, 1, 3], lengths)] * B, jnp.int32)
  y = APPLY(PARAMS, X, seg)[0]
  starts = np.cumsum((0,) + lengths)
  # Each document alone at the start of its own row: causality keeps the trailing zeros out.
  alone = jnp.stack([jnp.pad(X[0, a:b], ((0, T - (b - a)), (0, 0)))
                     for a, b in zip(starts[:-1], starts[1:], strict=True)])
  y_alone = jax.jit(LAYER.apply)({"params": PARAMS}, alone)[0]
  for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
    np.testing.assert_allclose(np.asarray(y[0, a:b]), np.asarray(y_alone[i, :b - a]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("lb", [-5.0, -1.0, -0.01])
def test_gate_stays_in_bounds_for_extreme_inputs(lb):
  z = jnp.asarray([-jnp.inf, -1e30, -1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4, 1e30, jnp.inf])
  z = jnp.broadcast_to(z[None, :, None, None], (1, z.shape[0], 3, 2))
  A_log = jnp.log(jnp.asarray([1.0, 16.0, 1e6]))
  for dt in (-1e6, 0.0, 1e6):
    g = np.asarray(bounded_decay(z, A_log, jnp.full((3, 2), dt), lb))
    assert g.dtype == np.float32
    assert np.all((g >= lb) & (g <= 0)), (dt, g.min(), g.max())


def test_layer_gate_in_bounds_for_huge_activations():
  lb = CFG.kda.gate_lower_bound
  y, state = APPLY(PARAMS, 1e4 * X, jnp.asarray(SEG))
  g = np.asarray(state["intermediates"]["g"][0])
  assert g.shape == (B, T, 4, 8)
  assert np.all((g >= lb) & (g <= 0))
  assert g.min() < 0.9 * lb and g.max() > 0.1 * lb  # the sample reaches both ends
  assert np.all(np.isfinite(np.asarray(y)))


def test_bfloat16_finite():
  layer = KDA(make_cfg(dtype="bfloat16"))

  def run(p):
    y, vjp = jax.vjp(lambda p: layer.apply({"params": p}, X, jnp.asarray(SEG))[0], p)
    return y, vjp(jnp.ones_like(y))[0]

  y, g = jax.jit(run)(PARAMS)
  assert y.dtype == jnp.bfloat16
  assert all(np.all(np.isfinite(np.asarray(l, np.float32))) for l in [y, *jax.tree.leaves(g)])
  np.testing.assert_allclose(np.asarray(y, np.float32), reference(PARAMS, X, SEG, CFG), rtol=0.1,
                             atol=0.05)


def test_bfloat16_gradients_match_float32():
  """The bf16 layer (bf16 projections, convolution and kernel operands; float32 norms, gates and state)
  against the float32 layer, which the float64 reference holds to 2e-4: input and parameter gradients
  within bf16 rounding (0.8% to 4.2% on this seed), each leaf relative to its own norm."""
  r = jnp.asarray(np.random.default_rng(6).standard_normal(X.shape), jnp.float32)

  def grads(dtype):
    layer = KDA(make_cfg(dtype=dtype))
    loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x, jnp.asarray(SEG))[0].astype(jnp.float32) * r)
    return jax.grad(loss, (0, 1))(PARAMS, X)

  g16, g32 = jax.jit(lambda: (grads("bfloat16"), grads("float32")))()
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g16), jax.tree.leaves(g32), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert err < 0.08, (jax.tree_util.keystr(path), err)  # 0.042 at most on this seed


def test_lower_bound_validated():
  for bad in (-5.5, 0.0, 0.3):
    with pytest.raises(ValueError, match="gate_lower_bound"):
      check_lower_bound(bad)
  # a config that skipped validate() still fails in the layer, with the same message
  c = base_config()
  c.model.kda.gate_lower_bound = -6.0
  with pytest.raises(ValueError, match="gate_lower_bound"):
    jax.eval_shape(KDA(ml_collections.FrozenConfigDict(c.model)).init, jax.random.key(0), X)


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match="D=64"):
    APPLY(PARAMS, X[..., :32])
  with pytest.raises(ValueError, match="segment_ids must have shape"):
    APPLY(PARAMS, X, jnp.zeros((B, T - 1), jnp.int32))
  with pytest.raises(ValueError, match="integer"):
    APPLY(PARAMS, X, jnp.zeros((B, T), jnp.float32))


# Rows of 48 tokens in pieces of 16: documents that cross a piece boundary, one that starts exactly on
# one (16), and one of two tokens across the next (31-32), shorter than the conv's reach.
PIECE_SEG = np.array([[0] * 10 + [1] * 6 + [2] * 20 + [3] * 12,
                      [4] * 31 + [1] * 2 + [4] * 15], np.int32)


@pytest.mark.parametrize("implementation, seg, conv_size", [
    ("xla", PIECE_SEG, 4), ("xla", None, 4), ("interpret", PIECE_SEG, 4),
    ("xla", PIECE_SEG, 1)])  # conv_size 1: no conv history to carry, only the state and the document
def test_layer_in_pieces_equals_whole_row(implementation, seg, conv_size):
  """seq_chunk: the state, the conv history and the document boundaries carry across pieces, so the
  output, the sown gate and every gradient equal the whole-row layer's."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((B, 48, CFG.d_model)), jnp.float32)
  seg = None if seg is None else jnp.asarray(seg)
  r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  params = PARAMS if conv_size == 4 else random_params(KDA(make_cfg(conv_size=conv_size)), X, 1)

  def run(seq_chunk):
    layer = KDA(make_cfg(implementation=implementation, seq_chunk=seq_chunk, conv_size=conv_size))

    def loss(p, x):
      (y, _), inter = layer.apply({"params": p}, x, seg, mutable=["intermediates"])
      return jnp.sum(y * r), (y, inter["intermediates"]["g"][0])

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)

  (_, (y_whole, g_whole)), grads_whole = run(0)
  (_, (y_pieces, g_pieces)), grads_pieces = run(16)
  np.testing.assert_allclose(np.asarray(y_pieces), np.asarray(y_whole), rtol=1e-5, atol=1e-5)
  # g comes out of two float32 dots over a 16-token piece or the 48-token row, which XLA:CPU may block
  # differently: rounding of a few 1e-6, the tolerance of y, which g feeds.
  np.testing.assert_allclose(np.asarray(g_pieces), np.asarray(g_whole), rtol=1e-5, atol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_whole), jax.tree.leaves(grads_pieces),
                          strict=True):
    a, b = np.asarray(a), np.asarray(b)
    # float32 sums over the row in another order (A_log's gradient sums every token): 1e-4 of the scale
    assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a)) + 1e-6, jax.tree_util.keystr(path)


@pytest.mark.parametrize("seq_chunk", [0, 16])
def test_layer_with_conv_kernels_equals_xla_conv(seq_chunk):
  """model.kda.conv_implementation="interpret" (the Pallas short-convolution kernels) gives the layer
  of the XLA convolution, output and every gradient, on the whole row and in pieces (where the conv
  runs over the previous piece's tail)."""
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.standard_normal((B, 48, CFG.d_model)), jnp.float32)
  seg = jnp.asarray(PIECE_SEG)
  r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def run(conv):
    layer = KDA(make_cfg(seq_chunk=seq_chunk, conv_implementation=conv))
    loss = lambda p, x: jnp.sum(layer.apply({"params": p}, x, seg)[0] * r)
    return jax.jit(jax.value_and_grad(loss, (0, 1)))(PARAMS, x)

  (loss_k, grads_k), (loss_x, grads_x) = run("interpret"), run("xla")
  np.testing.assert_allclose(loss_k, loss_x, rtol=1e-5)
  leaves_k = jax.tree.leaves(grads_k)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_x), leaves_k, strict=True):
    a, b = np.asarray(a), np.asarray(b)
    # dw sums per program, then over programs, where XLA sums the row at once: float32 order noise
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)) + 1e-6, jax.tree_util.keystr(path)


def test_layer_in_pieces_checks_the_row_length():
  layer = KDA(make_cfg(seq_chunk=32))
  with pytest.raises(ValueError, match="seq_chunk=32 does not divide"):
    layer.apply({"params": PARAMS}, jnp.zeros((1, 48, CFG.d_model)))
  with pytest.raises(ValueError, match="seq_chunk"):
    make_cfg(seq_chunk=24)  # not a multiple of chunk_size 16
