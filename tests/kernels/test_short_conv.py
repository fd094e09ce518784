"""conv_silu (pallas_kernels.short_conv): the Pallas kernels in interpret mode and the "xla" path's
hand-written backward pass, each against autodiff of the XLA reference formula, forward and both
gradients, on packed rows, with and without the l2 normalisation of each head; the reference itself is
tested against NumPy in test_kda_layer.py."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from pallas_kernels.short_conv import Blocks, conv_silu, short_conv
from pallas_kernels.short_conv.reference import l2_normalize

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

SMALL = Blocks(rows=16, cols=16)


def formula(x, w, doc, out_dtype, eps):
  """The reference formula, written out: the SiLU rounded to the output dtype, then normalised."""
  y = jax.nn.silu(short_conv(x, w, doc).astype(jnp.float32)).astype(out_dtype)
  return y if eps is None else l2_normalize(y.astype(jnp.float32), eps).astype(out_dtype)


def fwd_and_grads(impl, x, w, doc, dy, blocks=SMALL, out_dtype=jnp.float32, eps=None):
  """impl "autodiff": JAX's own differentiation of the reference formula (no custom VJP)."""
  if impl == "autodiff":
    f = lambda x, w: formula(x, w, doc, out_dtype, eps)
  else:
    f = lambda x, w: conv_silu(x, w, doc, implementation=impl, blocks=blocks, out_dtype=out_dtype,
                               normalize_eps=eps)
  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(dy.astype(y.dtype)))


def segments(rng, B, T):
  """Document ids of random lengths (1 to 12 tokens) per row."""
  return jnp.asarray(np.stack([np.cumsum(rng.random(T) < 0.15) for _ in range(B)]), jnp.int32)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), T=st.integers(1, 70),
       channels=st.sampled_from([(24,), (2, 16), (3, 5), (40,), (3, 32)]), W=st.sampled_from([2, 4]),
       packed=st.booleans(), normalize=st.booleans(), row_blocks=st.sampled_from([1, 2, 8]))
def test_interpret_matches_xla_reference(seed, T, channels, W, packed, normalize, row_blocks):
  """float32: rows not a multiple of the row block (masked), channel counts not a multiple of the
  column block (masked), one or several channel axes, documents of a few tokens (and taps of length 1),
  each head l2-normalised or not (the kernels take one power-of-two head per column block), dz
  programs of one or several row blocks (dw summed over them), the last one cut short by T."""
  blocks = Blocks(rows=16, cols=16, dz_row_blocks=row_blocks)
  eps = 1e-6 if normalize and channels[-1] in (16, 32) else None
  rng = np.random.default_rng(seed)
  B = 2
  x = jnp.asarray(rng.standard_normal((B, T, *channels)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((W, *channels)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((B, T, *channels)), jnp.float32)
  doc = segments(rng, B, T) if packed else None
  got = jax.jit(lambda *a: fwd_and_grads("interpret", *a, blocks=blocks, eps=eps))(x, w, doc, dy)
  want = jax.jit(lambda *a: fwd_and_grads("autodiff", *a, eps=eps))(x, w, doc, dy)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), T=st.integers(1, 40), channels=st.sampled_from([(24,), (2, 16), (3, 5)]),
       W=st.sampled_from([2, 4]), packed=st.booleans(), bf16=st.booleans(), normalize=st.booleans())
@example(seed=228, T=35, channels=(3, 5), W=2, packed=False, bf16=True, normalize=True)
def test_xla_backward_matches_autodiff(seed, T, channels, W, packed, bf16, normalize):
  """The "xla" path's hand-written backward pass (short_conv_vjp, reference.l2_normalize_vjp) against
  autodiff of the same forward: rows shorter than the taps, one-token documents, bf16 (whose rounding
  of the convolution before the SiLU, and of the SiLU before the norm, both must see alike). In bf16
  each leaf is judged against its own scale: dw sums up to 2 x 40 bf16-rounded products per tap, so an
  entry can be off by a few hundredths of the leaf's largest (seed 228: 0.057 where the largest is
  11.3, the leaf's norm-relative error 4.3e-3)."""
  eps = 1e-6 if normalize else None
  rng = np.random.default_rng(seed)
  B, dt = 2, jnp.bfloat16 if bf16 else jnp.float32
  x = jnp.asarray(rng.standard_normal((B, T, *channels)), dt)
  w = jnp.asarray(rng.standard_normal((W, *channels)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((B, T, *channels)), jnp.float32)
  doc = segments(rng, B, T) if packed else None
  got = jax.jit(lambda *a: fwd_and_grads("xla", *a, out_dtype=dt, eps=eps))(x, w, doc, dy)
  want = jax.jit(lambda *a: fwd_and_grads("autodiff", *a, out_dtype=dt, eps=eps))(x, w, doc, dy)
  assert got[1].dtype == dt and got[2].dtype == jnp.float32
  if not bf16:
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    return
  for g, e in zip(got, want, strict=True):
    g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
    scale = max(np.abs(e).max(), 1.0)
    np.testing.assert_allclose(g, e, rtol=2e-2, atol=2e-2 * scale)
    assert np.linalg.norm(g - e) <= 1e-2 * max(np.linalg.norm(e), 1.0)


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_bfloat16_and_default_blocks(eps):
  """bf16 inputs with the default blocks: the kernel rounds the convolution to bf16 before the SiLU, as
  the reference does, so the forward pass matches to bf16 output rounding and the gradients within
  bf16 noise; dx comes back in bf16. Normalised: heads of 32 channels, one per column block."""
  rng = np.random.default_rng(0)
  B, T, C = 2, 40, 160  # 3 row blocks, the last cut short; 2 column blocks, the last masked
  x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, C)) * 0.5, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((B, T, C)), jnp.bfloat16)
  doc = segments(rng, B, T)
  if eps is not None:
    x, w, dy = (a.reshape(*a.shape[:-1], 5, 32) for a in (x, w, dy))
  got = fwd_and_grads("interpret", x, w, doc, dy, Blocks(), jnp.bfloat16, eps)
  want = fwd_and_grads("autodiff", x, w, doc, dy, Blocks(), jnp.bfloat16, eps)
  assert got[1].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
  for a, b in zip(got, want, strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("impl", ["interpret", "xla"])
@pytest.mark.parametrize("poisoned", ["first", "second"])
def test_documents_do_not_mix(impl, eps, poisoned):
  """NaN in every input of one document: nothing of it reaches the other one's outputs or gradients.
  The forward taps reach back, so a NaN first document tests them; the backward's transposed taps
  reach forward, so a NaN second document tests those. A tap that crossed the boundary would carry
  the NaN, and so would a mask applied as a product (NaN * 0)."""
  rng = np.random.default_rng(1)
  bad, good = (slice(0, 20), slice(20, 40)) if poisoned == "first" else (slice(20, 40), slice(0, 20))
  x = jnp.asarray(rng.standard_normal((1, 40, 16)), jnp.float32).at[:, bad].set(jnp.nan)
  dy = jnp.asarray(rng.standard_normal((1, 40, 16)), jnp.float32).at[:, bad].set(jnp.nan)
  w = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  doc = jnp.asarray([[0] * 20 + [1] * 20], jnp.int32)
  y, vjp = jax.vjp(lambda x: conv_silu(x, w, doc, implementation=impl, blocks=SMALL, normalize_eps=eps), x)
  (dx,) = vjp(dy)
  want_y, want_vjp = jax.vjp(lambda x: conv_silu(x, w, None, implementation="xla", normalize_eps=eps),
                             x[:, good])
  np.testing.assert_allclose(y[:, good], want_y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx[:, good], want_vjp(dy[:, good])[0], rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise():
  x, w = jnp.zeros((1, 8, 16)), jnp.zeros((4, 16))
  with pytest.raises(ValueError, match="implementation"):
    conv_silu(x, w, implementation="cuda")
  with pytest.raises(ValueError, match="weight channels"):
    conv_silu(x, jnp.zeros((4, 8)), implementation="interpret")
  with pytest.raises(ValueError, match="doc_BT"):
    conv_silu(x, w, jnp.zeros((1, 7), jnp.int32), implementation="interpret")
  with pytest.raises(ValueError, match="needs a GPU"):
    conv_silu(x, w, implementation="pallas")
  with pytest.raises(ValueError, match="power of two"):
    Blocks(rows=24)
  with pytest.raises(ValueError, match="dz_row_blocks"):
    Blocks(dz_row_blocks=0)
  with pytest.raises(ValueError, match="normalize_eps"):
    conv_silu(x, w, implementation="xla", normalize_eps=0.0)
  with pytest.raises(ValueError, match="power-of-two last axis"):
    conv_silu(jnp.zeros((1, 8, 2, 24)), jnp.zeros((4, 2, 24)), implementation="interpret", normalize_eps=1e-6)


@pytest.mark.parametrize("eps", [None, 1e-6])
def test_lowers_to_triton_for_h200(monkeypatch, eps):
  """The GPU path (the forward kernel and the backward pass's two) lowers to Triton for an abstract
  H200, without a GPU, at the KDA layer's shape and dtype."""
  from pallas_kernels.short_conv import ops
  monkeypatch.setattr(ops.jax, "default_backend", lambda: "gpu")
  sd = lambda s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)

  def f(x, w, doc):
    y, vjp = jax.vjp(lambda x, w: conv_silu(x, w, doc, implementation="pallas", normalize_eps=eps), x, w)
    return y, vjp(y)

  h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
    text = jax.jit(f).trace(sd((2, 1000, 8, 128)), sd((4, 8, 128), jnp.float32),
                            sd((2, 1000), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3
