"""Per-document attention (pallas_kernels.attention), causal and not: the Pallas kernels in interpret mode vs
a float64 reference, forward and gradients, on packed rows of random document lengths."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from pallas_kernels.attention import Blocks, document_attention, document_attention_reference

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# Small, unequal blocks: the forward, dq and dk/dv kernels each see a different tiling of the row.
SMALL = Blocks(fwd_q=32, fwd_k=16, dq_q=16, dq_k=32, dkv_q=32, dkv_k=16)
B, T, H, D, V = 2, 83, 2, 16, 8   # T is not a multiple of any block
SCALE = D ** -0.5


def documents(seg_T):
  """(lo, hi) of each run of equal ids."""
  cuts = [0, *(np.flatnonzero(np.diff(seg_T)) + 1), len(seg_T)]
  return list(zip(cuts[:-1], cuts[1:], strict=True))


def numpy_attention(q, k, v, seg, do=None, causal=True):
  """Float64, one document at a time: softmax over the document's causal prefix, or over all of it when
  not causal. With do, (o, dq, dk, dv): o and the gradients of sum(o * do), written out by hand."""
  grads = do is not None
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  do = np.asarray(do, np.float64) if grads else np.zeros(v.shape)
  o, dq, dk, dv = np.zeros(v.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  for b in range(q.shape[0]):
    for lo, hi in documents(seg[b]):
      d = slice(lo, hi)
      s = np.einsum("thd,shd->hts", q[b, d], k[b, d]) * SCALE
      if causal:
        s = np.where(np.tril(np.ones((hi - lo, hi - lo), bool)), s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      o[b, d] = np.einsum("hts,shv->thv", p, v[b, d])
      dp = np.einsum("thv,shv->hts", do[b, d], v[b, d])
      ds = p * (dp - np.einsum("hts,hts->ht", dp, p)[..., None]) * SCALE
      dq[b, d] = np.einsum("hts,shd->thd", ds, k[b, d])
      dk[b, d] = np.einsum("hts,thd->shd", ds, q[b, d])
      dv[b, d] = np.einsum("hts,thv->shv", p, do[b, d])
  return (o, dq, dk, dv) if grads else o


def inputs(seed, shape=(B, T, H, D, V), dtype=jnp.float32):
  b, t, h, d, v = shape
  ks = jax.random.split(jax.random.key(seed), 4)
  q, k = (jax.random.normal(ks[i], (b, t, h, d), jnp.float32).astype(dtype) for i in range(2))
  return q, k, jax.random.normal(ks[2], (b, t, h, v), jnp.float32).astype(dtype), \
      jax.random.normal(ks[3], (b, t, h, v), jnp.float32).astype(dtype)


def segments_from_lengths(lengths, t):
  """Segment ids of one row: document i (ids 0, 1, ...) takes lengths[i] positions; the last runs on."""
  ids = np.repeat(np.arange(len(lengths)), lengths)[:t]
  return np.concatenate([ids, np.full(t - len(ids), len(lengths), int)]).astype(np.int32)


def fwd_and_grads(impl, blocks=SMALL, causal=True):
  def f(q, k, v, do, seg):
    o, vjp = jax.vjp(lambda q, k, v: document_attention(q, k, v, seg, scale=SCALE, causal=causal,
                                                        implementation=impl, blocks=blocks), q, k, v)
    return (o, *vjp(do))
  return f


def reference_fwd_and_grads(q, k, v, do, seg, causal=True):
  """The dense reference and its autodiff in float64 (as NumPy arrays)."""
  with jax.enable_x64(True):
    x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, do)]
    seg = None if seg is None else jnp.asarray(seg)
    o, vjp = jax.vjp(lambda q, k, v: document_attention_reference(q, k, v, seg, scale=SCALE, causal=causal),
                     *x64[:3])
    return tuple(np.asarray(x) for x in (o, *vjp(x64[3])))


def traced_fwd_and_grads(causal):
  """(jitted interpret-mode output and gradients at the shapes of inputs(), the list of its traces)."""
  traces = []

  def f(*args):
    traces.append(1)
    return fwd_and_grads("interpret", causal=causal)(*args)

  f = jax.jit(f)
  # The first lowering imports JAX's lazily loaded Pallas modules, which changes the trace context once:
  # lowered (not compiled) here, the tests' first call traces and compiles once more, and only once.
  f.lower(*inputs(0), jnp.zeros((B, T), jnp.int32))
  traces.clear()
  return f, traces


@pytest.fixture(scope="module")
def interpret_fg():
  return traced_fwd_and_grads(causal=True)


@pytest.fixture(scope="module")
def noncausal_fg():
  """The non-causal twin of interpret_fg: one compiled function for every non-causal test."""
  return traced_fwd_and_grads(causal=False)


@settings(max_examples=5, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=B, max_size=B))
@example([[T], [T]])                      # one document per row: the whole causal triangle
@example([[1] * 10, [16, 16, 32]])         # one-token documents; boundaries on the block grid
@example([[40, 1, 2], [5, 70]])            # documents crossing several blocks
def test_matches_float64_reference(interpret_fg, lengths):
  f, traces = interpret_fg
  seg = jnp.asarray(np.stack([segments_from_lengths(row, T) for row in lengths]))
  q, k, v, do = inputs(0)
  got = f(q, k, v, do, seg)
  assert len(traces) <= 1, "new document boundaries must not retrace"
  np.testing.assert_allclose(got[0], numpy_attention(q, k, v, np.asarray(seg)), rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(got, reference_fwd_and_grads(q, k, v, do, seg), rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=B, max_size=B))
@example([[T], [T]])                        # one document per row: the whole square
@example([[1] * T, [1] * 10 + [16, 16]])    # one-token documents (a whole row of them); block-grid ends
@example([[20, 30, 1, 1], [40, 1, 2]])      # rows whose first key block (of 16) holds no key they see
def test_noncausal_matches_float64_numpy(noncausal_fg, lengths):
  """causal=False: every query sees every key of its document, earlier and later, and nothing else.
  Output and gradients of the interpret kernels against the per-document float64 NumPy softmax."""
  f, traces = noncausal_fg
  seg = np.stack([segments_from_lengths(row, T) for row in lengths])
  q, k, v, do = inputs(7)
  got = f(q, k, v, do, jnp.asarray(seg))
  assert len(traces) <= 1, "new document boundaries must not retrace"
  chex.assert_trees_all_close(got, numpy_attention(q, k, v, seg, do, causal=False), rtol=1e-5, atol=1e-5)


def test_noncausal_xla_matches_float64_numpy():
  """The dense reference (implementation="xla") with causal=False, float32, one row a single document and
  one row of one-token and longer documents."""
  q, k, v, do = inputs(8)
  seg = np.stack([segments_from_lengths([T], T), segments_from_lengths([1, 1, 1, 20, 1, 30], T)])
  got = jax.jit(fwd_and_grads("xla", causal=False))(q, k, v, do, jnp.asarray(seg))
  chex.assert_trees_all_close(got, numpy_attention(q, k, v, seg, do, causal=False), rtol=1e-5, atol=1e-5)


def test_noncausal_documents_do_not_leak(noncausal_fg):
  """Fresh inputs (q, k, v and the output cotangent) everywhere but one document per row, documents that
  do not line up with any block (so blocks are shared across documents): that document's output and
  gradients stay bit for bit the same, whether the others lie before or after it."""
  f, _ = noncausal_fg
  seg = np.stack([segments_from_lengths([21, 30], T), segments_from_lengths([7, 50], T)])
  keep = np.zeros((B, T), bool)
  keep[0, 21:51] = keep[1, 7:57] = True
  x = inputs(9)
  others = [jnp.where(keep[:, :, None, None], a, b) for a, b in zip(x, inputs(10), strict=True)]
  got, got_others = f(*x, jnp.asarray(seg)), f(*others, jnp.asarray(seg))
  for a, b in zip(got, got_others, strict=True):
    np.testing.assert_array_equal(np.asarray(a)[keep], np.asarray(b)[keep])
    assert not np.array_equal(np.asarray(a)[~keep], np.asarray(b)[~keep])


@pytest.mark.parametrize("shape", [(1, 1, 1, 16, 16), (1, 130, 3, 32, 16), (2, 40, 2, 24, 40)])
def test_random_shapes_with_default_blocks(shape):
  """Rows of one token, shorter and longer than the default 128-token blocks, K > V and K < V, widths
  that are not powers of two (padded inside the op), no segments and segments."""
  q, k, v, do = inputs(1, shape)
  rng = np.random.default_rng(shape[1])
  for seg in (None, jnp.asarray(np.sort(rng.integers(0, 4, shape[:2]), axis=1), jnp.int32)):
    got = jax.jit(fwd_and_grads("interpret", Blocks()))(q, k, v, do, seg)
    chex.assert_trees_all_close(got, reference_fwd_and_grads(q, k, v, do, seg), rtol=1e-5, atol=1e-5)


def test_bfloat16_within_1e2_of_float32():
  q, k, v, do = inputs(2)
  seg = jnp.asarray(np.stack([segments_from_lengths([30, 20], T)] * B))
  got = jax.jit(fwd_and_grads("interpret"))(*(x.astype(jnp.bfloat16) for x in (q, k, v, do)), seg)
  want = reference_fwd_and_grads(*(x.astype(jnp.bfloat16) for x in (q, k, v, do)), seg)
  for a, b in zip(got, want, strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


def test_repeated_ids_start_new_documents():
  """A document is a run: ids [3, 3, 5, 5, 3] are three documents, like document_ids in the model."""
  q, k, v, do = inputs(3, (1, 5, 1, 16, 16))
  got = document_attention(q, k, v, jnp.asarray([[3, 3, 5, 5, 3]]), scale=SCALE, implementation="interpret")
  np.testing.assert_allclose(got, numpy_attention(q, k, v, np.asarray([[0, 0, 1, 1, 2]])), rtol=1e-5)
  np.testing.assert_allclose(got[0, 4], v[0, 4], rtol=1e-6)  # alone in its document


@pytest.mark.parametrize("causal", [True, False])
def test_tiles_outside_documents_are_never_read(request, causal):
  """Three documents: 32 tokens, 32 tokens and the rest of the row (T=83, padded to 96); NaN in the keys
  and values of the first and in every input of the third. A kernel that started before the middle
  document's span (forward, dq; dk/dv too when not causal) or ran past its end (dk/dv, whose queries come
  from later rows; forward and dq too when not causal) would carry the NaN into the middle one's results:
  masking zeroes the probabilities, but 0 * NaN is NaN. (The compiled function of
  test_matches_float64_reference, or of test_noncausal_matches_float64_numpy, at its shapes.)"""
  f, _ = request.getfixturevalue("interpret_fg" if causal else "noncausal_fg")
  q, k, v, do = inputs(4)
  seg = jnp.asarray(np.stack([segments_from_lengths([32, 32], T)] * B))
  first, third = (lambda x: x.at[:, :32].set(jnp.nan)), (lambda x: x.at[:, 64:].set(jnp.nan))
  got = f(third(q), third(first(k)), third(first(v)), third(do), seg)
  mid = lambda x: x[:, 32:64]
  want = reference_fwd_and_grads(mid(q), mid(k), mid(v), mid(do), mid(seg), causal=causal)
  chex.assert_trees_all_close(tuple(mid(x) for x in got), want, rtol=1e-5, atol=1e-5)


def numpy_max_logits(q, k, seg, causal=True):
  """Float64 per-head max of SCALE q.k over the causal pairs (or all pairs) inside each document."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  best = np.full(q.shape[2], -np.inf)
  for b in range(q.shape[0]):
    for lo, hi in documents(seg[b]):
      s = np.einsum("thd,shd->hts", q[b, lo:hi], k[b, lo:hi]) * SCALE
      if causal:
        s = np.where(np.tril(np.ones((hi - lo, hi - lo), bool)), s, -np.inf)
      best = np.maximum(best, s.max(axis=(1, 2)))
  return best


@pytest.mark.parametrize("lengths, causal", [([[T], [T]], True), ([[40, 1, 2], [5, 70]], True),
                                             ([[40, 1, 2], [5, 70]], False)])
def test_max_logit_matches_float64_and_leaves_gradients_alone(request, lengths, causal):
  """QK-clip's statistic from the forward kernel (and from the dense reference): per head, the largest
  visible logit of any row, padding rows excluded (T=83 pads to 96). Two keys of row 0 are aligned with
  the query at position 50: one later in time (60) and one earlier (5, another document in the second
  layout), so a causal kernel that looked ahead, or any kernel that looked across documents, would
  report a logit the reference does not. Not causal, key 60 is visible and gives the max, and a larger
  key in row 1 (80, another document than that row's query 50) catches a look across documents. The
  gradients of o do not change when the max is also asked for."""
  q, k, v, do = inputs(5)
  q = q * jnp.array([1.0, 4.0])[None, None, :, None]  # heads far apart
  seg = np.stack([segments_from_lengths(row, T) for row in lengths])
  k = k.at[0, 60].set(5.0 * q[0, 50]).at[0, 5].set(4.0 * q[0, 50])
  if not causal:
    k = k.at[1, 80].set(8.0 * q[1, 50])
    one_document = np.zeros_like(seg)
    assert np.all(numpy_max_logits(q, k, one_document, causal=False) > numpy_max_logits(q, k, seg, False))
  want = numpy_max_logits(q, k, seg, causal)
  for impl in ("interpret", "xla"):
    def f(q, k, v, impl=impl):
      return document_attention(q, k, v, jnp.asarray(seg), scale=SCALE, causal=causal, implementation=impl,
                                blocks=SMALL, return_max_logit=True)
    (o, max_H), vjp = jax.vjp(f, q, k, v)
    np.testing.assert_allclose(max_H, want, rtol=1e-5)
    assert max_H.dtype == jnp.float32
    grads = vjp((do, jnp.ones_like(max_H)))  # a cotangent on the max is ignored
    # Without the max: interpret mode through the compiled function of the float64 comparisons.
    fixture = "interpret_fg" if causal else "noncausal_fg"
    plain = request.getfixturevalue(fixture)[0] if impl == "interpret" else fwd_and_grads(impl, causal=causal)
    chex.assert_trees_all_close((o, *grads), plain(q, k, v, do, jnp.asarray(seg)), rtol=1e-6, atol=1e-6)


def test_max_logit_leaves_out_the_padding_rows():
  """Every real logit negative (queries positive, keys negative): the padding rows that T=83 gets
  (to 96), whose zero queries and keys give logits of 0, would win the max if they were counted."""
  q, k, v, _ = inputs(6)
  q, k = jnp.abs(q) + 0.1, -jnp.abs(k) - 0.1
  seg = np.stack([segments_from_lengths([30, 20], T)] * B)
  want = numpy_max_logits(q, k, seg)
  assert np.all(want < 0)
  _, max_H = document_attention(q, k, v, jnp.asarray(seg), scale=SCALE, implementation="interpret",
                                blocks=SMALL, return_max_logit=True)
  np.testing.assert_allclose(max_H, want, rtol=1e-5)


def test_blocked_max_logits_leave_out_the_padding_rows():
  """moejax.layers.mla.max_logits, the XLA paths' QK-clip statistic, on blocks that pad T=83 to 96:
  with every real logit negative, its padded query rows (zero, so logit 0 against padded keys) must not
  count, as the kernels' do not."""
  from moejax.layers.mla import max_logits
  from pallas_kernels.segments import document_ids

  q, k, _, _ = inputs(6)
  q, k = jnp.abs(q) + 0.1, -jnp.abs(k) - 0.1
  seg = np.stack([segments_from_lengths([30, 20], T)] * B)
  want = numpy_max_logits(q, k, seg)
  assert np.all(want < 0)
  got = max_logits(q, k, document_ids(jnp.asarray(seg)), SCALE, chunk=32)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_bad_inputs_raise():
  q, k, v, _ = inputs(0)
  with pytest.raises(ValueError, match=r"v \[B,T,H,V\]"):
    document_attention(q, k, v[..., 0], scale=1.0, implementation="interpret")
  with pytest.raises(ValueError, match="floating point"):
    document_attention(*(x.astype(jnp.int32) for x in (q, k, v)), scale=1.0, implementation="xla")
  with pytest.raises(ValueError, match="implementation"):
    document_attention(q, k, v, scale=1.0, implementation="cuda")
  with pytest.raises(ValueError, match="one shape"):
    document_attention(q, k[:, :5], v, scale=1.0, implementation="interpret")
  with pytest.raises(ValueError, match="share a dtype"):
    document_attention(q, k.astype(jnp.bfloat16), v, scale=1.0, implementation="interpret")
  with pytest.raises(ValueError, match="integer"):
    document_attention(q, k, v, jnp.zeros((B, T)), scale=1.0, implementation="interpret")
  with pytest.raises(ValueError, match="power of two"):
    Blocks(fwd_q=48)
  with pytest.raises(ValueError, match="causal must be a Python bool"):
    document_attention(q, k, v, scale=1.0, causal=jnp.asarray(False), implementation="interpret")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="needs a GPU backend"):
      document_attention(q, k, v, scale=1.0, implementation="pallas")


@pytest.mark.parametrize("width, causal", [(128, True), (96, True), (128, False)])
def test_lowers_to_triton_for_h200(monkeypatch, width, causal):
  """The GPU path (forward, dq, dk/dv) lowers to Triton for an abstract H200, without a GPU, also for
  head widths that are not powers of two and without causality."""
  from pallas_kernels.attention import ops
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
  sd = lambda s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)

  def f(q, k, v, seg):
    o, vjp = jax.vjp(lambda q, k, v: document_attention(q, k, v, seg, scale=SCALE, causal=causal), q, k, v)
    return o, vjp(o)

  h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
    shape = (1, 1000, 2, width)
    text = jax.jit(f).trace(sd(shape), sd(shape), sd(shape),
                            sd((1, 1000), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3
