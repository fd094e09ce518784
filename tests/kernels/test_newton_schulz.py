"""Newton-Schulz's symmetric products (pallas_kernels/newton_schulz) against reference.gram_poly in
float32, and Muon's iteration with them against its einsum form, on one device and under a mesh.

The kernel runs in Pallas interpret mode here, as everywhere on the CPU."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from moejax.parallel import mesh as meshlib
from moejax.training.muon import NS_COEFFS, newton_schulz, orthogonalise
from pallas_kernels.kda.lowering import Tuning
from pallas_kernels.newton_schulz import GRAM_BLOCKS, POLY_BLOCKS, Blocks, gram_poly, gram_poly_reference
from pallas_kernels.newton_schulz import kernel as ns_kernel
from pallas_kernels.newton_schulz.kernel import SHARED_MEMORY_BYTES

A, B, C = NS_COEFFS
HIGHEST = jax.lax.Precision.HIGHEST


def _symmetric(key, shape):
  x = jax.random.normal(key, shape, jnp.float32)
  return (x + jnp.swapaxes(x, -2, -1)) / 2


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), m=st.integers(1, 70), n=st.integers(1, 90), rows=st.sampled_from([16, 32]),
       depth=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_gram_matches_the_reference(batch, m, n, rows, depth, seed):
  """X X^T over shapes that the blocks do not divide (masked tiles), and a single tile."""
  x = jax.random.normal(jax.random.key(seed), (batch, m, n), jnp.float32)
  got = gram_poly(x, implementation="interpret", blocks=Blocks(rows=rows, depth=depth))
  want = gram_poly_reference(x, precision=HIGHEST)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(n))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.swapaxes(got, -2, -1)))


SCALES = [(C, B, A), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (-0.5, 2.0, 0.0)]


@settings(max_examples=5, deadline=None)
@given(m=st.integers(1, 70), rows=st.sampled_from([16, 32]), seed=st.integers(0, 2**16),
       scales=st.sampled_from(SCALES))
def test_poly_of_a_symmetric_matrix_matches_the_reference(m, rows, seed, scales):
  """a I + b S + c S^2 (the quintic's P) and each term alone, S symmetric."""
  s = _symmetric(jax.random.key(seed), (2, m, m))
  got = gram_poly(s, *scales, implementation="interpret", blocks=Blocks(rows=rows, depth=16))
  chex.assert_trees_all_close(got, gram_poly_reference(s, *scales, precision=HIGHEST), rtol=1e-5,
                              atol=1e-4 * np.sqrt(m))


def test_bf16_products_round_once():
  """bf16 in and out: the float32 accumulation rounded once to bf16, leading batch axes kept."""
  x = jax.random.normal(jax.random.key(3), (2, 3, 40, 72), jnp.bfloat16)
  got = gram_poly(x, implementation="interpret", blocks=Blocks(rows=16, depth=32))
  assert got.shape == (2, 3, 40, 40) and got.dtype == jnp.bfloat16
  want = gram_poly_reference(x, precision=HIGHEST, out_dtype=jnp.float32)
  # within one bf16 rounding of the exact products (and float32 sums in another order)
  err = np.abs(np.asarray(got, np.float32) - np.asarray(want))
  assert np.all(err <= 2 ** -8 * np.abs(np.asarray(want)) + 1e-3), err.max()


@pytest.mark.parametrize("shape, poly_blocks", [
    ((2, 80, 48), None), ((4, 33, 33), None), ((1, 136, 160), None),
    ((2, 48, 80), Blocks(rows=16, depth=16))])
def test_newton_schulz_with_the_kernels_is_the_einsum_form(shape, poly_blocks):
  """In float32 both forms compute the same products (the kernels' S^2 as S S^T), transposing when
  m > n, to float32 rounding, at P's default blocks and at blocks that tile S 3 x 3; the result is
  near-orthogonal either way."""
  x = jax.random.normal(jax.random.key(4), shape, jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = newton_schulz(x)
  got = newton_schulz(x, implementation="interpret", **({"poly_blocks": poly_blocks} if poly_blocks else {}))
  chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_orthogonalise_under_a_mesh_splits_the_experts(axis_type):
  """Experts split over 4 devices and their matrices' rows over 2 (fsdp), on a mesh of either axis type
  (moejax.train's are Auto): the kernels run in shard_map on whole matrices, each device on its own
  experts, with the result of one device, split by expert as the input was."""
  x = jax.random.normal(jax.random.key(5), (8, 32, 48), jnp.float32)
  dims = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  names = ("expert", "embed", "mlp")
  want = orthogonalise(x, dims, jnp.float32, implementation="interpret")
  mesh = meshlib.make_mesh(expert=4, fsdp=2, axis_types=(axis_type,) * len(meshlib.MESH_AXES))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("expert", "fsdp", None)))
    f = jax.jit(lambda x: orthogonalise(x, dims, jnp.float32, implementation="interpret", logical_axes=names))
    got = f(xs)
    assert got.sharding.spec[0] == "expert", got.sharding
    # each device holds (and iterates) its two experts only
    assert {s.data.shape for s in got.addressable_shards} == {(2, 32, 48)}
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_newton_schulz_gives_each_product_its_blocks(monkeypatch):
  """S = X X^T runs at GRAM_BLOCKS and P at `poly_blocks` (POLY_BLOCKS unless given), fitted to the
  matrices and to the dtype's shared memory."""
  seen = []
  real = ns_kernel.gram_poly_pallas

  def recording(x, scale_xx, scale_x, shift, *, blocks, interpret):
    seen.append(("P" if scale_x else "S", blocks, blocks.fit(*x.shape[1:], x.dtype.itemsize)))
    return real(x, scale_xx, scale_x, shift, blocks=blocks, interpret=interpret)

  monkeypatch.setattr(ns_kernel, "gram_poly_pallas", recording)
  x = jax.random.normal(jax.random.key(5), (1, 256, 320), jnp.bfloat16)
  newton_schulz(x, steps=1, implementation="interpret")
  assert [(kind, blocks) for kind, blocks, _ in seen] == [("S", GRAM_BLOCKS), ("P", POLY_BLOCKS)]
  assert seen[1][2].depth == 128  # bf16: P's operand tiles fit at depth 128
  seen.clear()
  newton_schulz(x.astype(jnp.float32), steps=1, implementation="interpret")
  assert seen[1][2].depth == 64  # float32: halved to fit
  seen.clear()
  mine = Blocks(rows=32, depth=16)
  newton_schulz(x[:, :64, :64], steps=1, implementation="interpret", poly_blocks=mine)
  assert [(kind, blocks) for kind, blocks, _ in seen] == [("S", GRAM_BLOCKS), ("P", mine)]


def test_blocks_fit_an_sm90_block_of_shared_memory():
  """The estimate reproduces the H100's refusal (262,144 bytes for 128 x 128 x 128, 4 stages, bf16), and
  fit halves the depth until the tiles fit."""
  four_stages = Blocks(rows=128, depth=128, tuning=Tuning(num_warps=8, num_stages=4))
  assert four_stages.shared_memory_bytes(2) == 262_144 > SHARED_MEMORY_BYTES
  assert four_stages.fit(512, 512, 2).depth == 64
  for blocks in (GRAM_BLOCKS, POLY_BLOCKS, four_stages):
    for itemsize in (2, 4):
      fitted = blocks.fit(4096, 4096, itemsize)
      assert fitted.shared_memory_bytes(itemsize) <= SHARED_MEMORY_BYTES
      assert fitted.rows == blocks.rows and fitted.tuning == blocks.tuning
  assert POLY_BLOCKS.fit(512, 512, 2) == POLY_BLOCKS  # what the sweep timed is what runs
  assert Blocks().fit(40, 24, 2) == Blocks(rows=64, depth=32)


def test_an_empty_batch_gives_an_empty_result():
  got = gram_poly(jnp.ones((0, 4, 6), jnp.bfloat16), implementation="interpret")
  assert got.shape == (0, 4, 4) and got.dtype == jnp.bfloat16


def test_bad_inputs_are_refused():
  x = jnp.ones((4, 6), jnp.float32)
  with pytest.raises(ValueError, match="square"):
    gram_poly(x, 1.0, 0.5, implementation="interpret")
  with pytest.raises(ValueError, match="bfloat16 or float32"):
    gram_poly(x.astype(jnp.float16), implementation="interpret")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="needs a GPU"):
      gram_poly(x, implementation="pallas")
  with pytest.raises(ValueError, match="unknown gram_poly implementation"):
    gram_poly(x, implementation="xla")
  with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
    gram_poly(jnp.ones((4,)), implementation="interpret")
  with pytest.raises(ValueError, match="unknown Newton-Schulz implementation"):
    newton_schulz(x, implementation="triton")
  with pytest.raises(ValueError, match="power of two"):
    Blocks(rows=48)
