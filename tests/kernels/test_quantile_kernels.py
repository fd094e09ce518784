"""The exact quantile balance's kernels (pallas_kernels.quantile) against their XLA reference, bit for bit.

On the CPU the kernels run in Pallas interpret mode; with JAX_PLATFORMS=cuda on a GPU the same tests run
the Triton kernels against XLA:GPU. Ties are made by quantising values to a few levels; signed zeros and
negative values are mixed in where the order must not be the IEEE one (-0.0 sorts below +0.0).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.moe.balance import quantile_bias
from pallas_kernels.quantile import Blocks, choice_margins, exact_threshold, margin_threshold
from pallas_kernels.quantile import reference as ref

KERNELS = "pallas" if jax.default_backend() == "gpu" else "interpret"


def assert_same_bits(got, want):
  """Equal as bit patterns (assert_trees_all_equal alone would take -0.0 for +0.0)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  chex.assert_trees_all_equal(got.view(np.uint32), want.view(np.uint32))


def draw(rng, shape, levels: int, signed: bool):
  """float32 values: sigmoid-like scores in (0, 1), or (signed) normals over several magnitudes;
  levels > 0 rounds them to multiples of 1 / levels, so many tie; 5% are then set to -0.0 or +0.0."""
  if signed:
    v = rng.standard_normal(shape) * 10.0 ** rng.integers(-2, 3, shape[-1:])
  else:
    v = 1 / (1 + np.exp(-rng.standard_normal(shape) - rng.standard_normal(shape[-1:])))
  if levels:
    v = np.round(v * levels) / levels
  v = v.astype(np.float32)
  zeros = rng.random(shape) < 0.05
  v[zeros] = np.where(rng.random(shape) < 0.5, np.float32(-0.0), np.float32(0.0))[zeros]
  return v


def margins_case(seed, m, n, k, levels, signed):
  rng = np.random.default_rng(seed)
  s = draw(rng, (m, n), levels, signed)
  b = np.round(rng.standard_normal(n) * 0.3 * max(levels, 1)) / max(levels, 1)  # ties survive the bias
  return jnp.asarray(s), jnp.asarray(b, jnp.float32)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 150), n=st.sampled_from([3, 8, 24, 64]),
       k_pick=st.sampled_from(["1", "2", "n-1", "mid"]), levels=st.sampled_from([0, 2, 5]),
       signed=st.booleans())
def test_choice_margins_match_reference(seed, m, n, k_pick, levels, signed):
  """Rows not a multiple of the row block, experts not a power of two, k from 1 to n - 1, and (levels > 0)
  ties at and around the k-th place."""
  k = {"1": 1, "2": min(2, n - 1), "n-1": n - 1, "mid": max(1, n // 3)}[k_pick]
  s, b = margins_case(seed, m, n, k, levels, signed)
  want = jax.jit(ref.choice_margins, static_argnums=2)(s, b, k)
  assert_same_bits(choice_margins(s, b, k, implementation=KERNELS), want)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), m=st.integers(2, 300), n=st.sampled_from([1, 3, 8]),
       frac=st.floats(0.0, 1.0), levels=st.sampled_from([0, 3, 50]), bits=st.sampled_from([2, 4, 8]))
def test_exact_threshold_matches_reference(seed, m, n, frac, levels, bits):
  """q from 1 to m - 1 (num_above rounded and clipped), negative and positive values, signed zeros and
  (levels > 0) many ties at the q-th place; radix widths of 2 (the default), 4 and 8 bits (that one
  counting with a comparison tile)."""
  v = jnp.asarray(draw(np.random.default_rng(seed), (m, n), levels, signed=True))
  num_above = frac * m
  blocks = Blocks(radix_bits=bits, per_candidate=bits <= 4)
  assert_same_bits(exact_threshold(v, num_above, implementation=KERNELS, blocks=blocks),
                   jax.jit(ref.exact_threshold, static_argnums=1)(v, num_above))


BLOCK_SHAPES = {
    "default": Blocks(),
    "blocks": Blocks(threshold_rows=64),
    "bits1": Blocks(radix_bits=1, threshold_rows=16, margin_rows=1),
    "bits4": Blocks(radix_bits=4, threshold_rows=32, margin_rows=16),
    "tile": Blocks(per_candidate=False),
    "tile_bits8": Blocks(radix_bits=8, threshold_rows=64, margin_rows=4, per_candidate=False),
}


@pytest.mark.parametrize("blocks", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
def test_one_sweep_matches_reference_for_every_block_shape(blocks):
  """margin_threshold (margins kernel writing column-major keys, then the threshold kernel) under each
  radix width and counting form, with a column in one block or in blocks that leave a ragged last one."""
  m, n, k = 203, 24, 3
  s, b = margins_case(7, m, n, k, levels=4, signed=False)
  for num_above in (1.0, m * k / n, m - 1.0) if blocks == Blocks() else (m * k / n,):
    want = ref.exact_threshold(ref.choice_margins(s, b, k), num_above)
    assert_same_bits(margin_threshold(s, b, k, num_above, implementation=KERNELS, blocks=blocks), want)
  want = ref.choice_margins(s, b, k)
  assert_same_bits(choice_margins(s, b, k, implementation=KERNELS, blocks=blocks), want)


def test_ties_at_the_kth_place_and_in_whole_rows():
  """Rows whose k-th and (k+1)-th largest tie, rows of one value (every expert chosen at margin 0), a row
  of -0.0 and +0.0 (top_k puts +0.0 first), infinities."""
  s = jnp.asarray([[0.5, 0.5, 0.5, 0.5], [0.9, 0.5, 0.5, 0.1], [0.9, 0.7, 0.5, 0.5], [-0.0, 0.0, -0.0, 0.0],
                   [0.2, 0.2, 0.1, 0.2], [np.inf, 0.3, -np.inf, 0.3]], jnp.float32)
  b = jnp.zeros(4, jnp.float32)
  for k in (1, 2, 3):
    assert_same_bits(choice_margins(s, b, k, implementation=KERNELS), ref.choice_margins(s, b, k))
  c = jnp.asarray(np.array([[0.5, -1.0], [0.5, -0.0], [0.5, 0.0], [0.25, 0.0]], np.float32))
  for num_above in (1, 2, 3):  # the q-th ties with the (q+1)-th in both columns for q = 1, 2
    assert_same_bits(exact_threshold(c, num_above, implementation=KERNELS), ref.exact_threshold(c, num_above))


def test_two_rows_and_one_row():
  """m = 2 (q = 1 whatever num_above is) and m = 1 (the row itself, no kernel)."""
  v = jnp.asarray([[1.0, -2.0, 0.0], [3.0, -2.0, -0.0]], jnp.float32)
  for num_above in (0.0, 1.0, 5.0):
    assert_same_bits(exact_threshold(v, num_above, implementation=KERNELS), ref.exact_threshold(v, num_above))
  assert_same_bits(exact_threshold(v[:1], 1.0, implementation=KERNELS), v[0])
  s = jnp.asarray([[0.1, 0.7, 0.3]], jnp.float32)
  assert_same_bits(margin_threshold(s, jnp.zeros(3), 1, 1 / 3, implementation=KERNELS),
                   ref.exact_threshold(ref.choice_margins(s, jnp.zeros(3), 1), 1 / 3))


@pytest.mark.parametrize("m, n, k", [(300, 24, 3), (130, 64, 8), (64, 3, 1)])
def test_quantile_bias_kernels_equal_xla(m, n, k):
  """The whole balance, jitted, warm-started from a nonzero bias: the same bits either way."""
  rng = np.random.default_rng(m + n)
  pop = 3 * rng.standard_normal(n)
  s = jnp.asarray(1 / (1 + np.exp(-(pop + rng.standard_normal((m, n))))), jnp.float32)
  bias = jnp.asarray(0.1 * rng.standard_normal(n), jnp.float32)
  run = lambda impl: jax.jit(lambda s, b: quantile_bias(s, k, b, 4, implementation=impl))(s, bias)
  want = run("xla")
  assert_same_bits(run(KERNELS), want)
  assert abs(float(jnp.mean(want))) < 1e-6


def test_implementation_errors():
  s, b = jnp.zeros((4, 3)), jnp.zeros(3)
  for fn in (lambda i: choice_margins(s, b, 1, implementation=i),
             lambda i: exact_threshold(s, 1.0, implementation=i),
             lambda i: quantile_bias(s, 1, implementation=i)):
    with pytest.raises(ValueError, match="unknown quantile balance implementation 'triton'"):
      fn("triton")
    if jax.default_backend() != "gpu":
      with pytest.raises(ValueError, match="'pallas' needs a GPU"):
        fn("pallas")
  with pytest.raises(ValueError, match=r"k=3 must be an int in \[1, num_experts - 1 = 2\]"):
    choice_margins(s, b, 3, implementation="interpret")
  with pytest.raises(ValueError, match="bias shape"):
    choice_margins(s, jnp.zeros(2), 1)
  with pytest.raises(ValueError, match="float32"):
    choice_margins(s.astype(jnp.bfloat16), b, 1, implementation="interpret")
  with pytest.raises(ValueError, match="rows >= 1"):
    exact_threshold(jnp.zeros((0, 3)), 1.0)
  with pytest.raises(ValueError, match="radix_bits must divide 32"):
    Blocks(radix_bits=3)
  with pytest.raises(ValueError, match="threshold_rows must be a power of two"):
    Blocks(threshold_rows=100)
  with pytest.raises(ValueError, match="per_candidate=True takes radix_bits <= 4"):
    Blocks(radix_bits=8)
