"""moejax.nn: matmul (float32 accumulation forward, and a backward pass in the compute dtype whose
gradients match float32 autodiff) and remat_pieces."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.nn import Dense, dense_apply, matmul, remat_pieces


@pytest.mark.parametrize("spec, x_shape, w_shape", [
    ("btd,dhk->bthk", (2, 5, 8), (8, 3, 4)),
    ("bthv,hvd->btd", (2, 5, 3, 4), (3, 4, 8)),
    ("md,dl->ml", (7, 8), (8, 6)),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_value_and_gradients(spec, x_shape, w_shape, dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  w = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
  out_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
  cot = jnp.asarray(rng.normal(size=out_shape), jnp.float32)
  ours = lambda x, w: jnp.sum(cot * matmul(spec, x, w, dtype, out_dtype=jnp.float32))
  # The reference: float32 autodiff on the inputs rounded to the compute dtype.
  ref = lambda x, w: jnp.sum(cot * jnp.einsum(spec, x.astype(dtype).astype(jnp.float32),
                                              w.astype(dtype).astype(jnp.float32)))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(ours(x, w), ref(x, w), rtol=tol)
  (dx, dw), (rx, rw) = jax.grad(ours, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  for got, want in ((dx, rx), (dw, rw)):
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


def test_matmul_backward_runs_in_the_compute_dtype():
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 3), jnp.float32)
  loss = lambda x, w: jnp.sum(matmul("md,df->mf", x, w, jnp.bfloat16, out_dtype=jnp.float32))
  grad = jax.grad(loss, (0, 1))
  text = jax.jit(grad).lower(x, w).as_text()
  operands = re.findall(r"stablehlo.dot_general.*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
  assert len(operands) == 2  # the two gradients (the forward value is not needed)
  assert all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b in operands), operands


def _dot_results(fn, *args) -> list[str]:
  """The result types of the dots in fn's lowered module, e.g. ["16x8xbf16"]."""
  text = jax.jit(fn).lower(*args).as_text()
  return re.findall(r"stablehlo.dot_general.*-> tensor<([^>]*)>", text)


def test_narrow_results_come_out_of_the_dot_itself():
  """A bf16 result (the forward's, x's gradient) is what the dot writes, not a float32 dot and a cast:
  XLA:GPU keeps such a float32 dot output in float32 between kernels. The float32 weight's gradient
  stays a float32 dot, and a bf16 dot accumulates in float32 all the same (the same bits here)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(512, 8)), jnp.float32)
  fwd = lambda x, w: matmul("md,df->mf", x, w, jnp.bfloat16)
  assert _dot_results(fwd, x, w) == ["16x8xbf16"]
  wide = jnp.einsum("md,df->mf", x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  as_f32 = lambda y: np.asarray(y, np.float32)
  np.testing.assert_array_equal(as_f32(fwd(x, w)), as_f32(wide.astype(jnp.bfloat16)))
  grads = jax.grad(lambda x, w: jnp.sum(fwd(x, w).astype(jnp.float32) ** 2), (0, 1))
  assert sorted(_dot_results(grads, x, w)) == ["16x512xbf16", "16x8xbf16", "512x8xf32"]
  assert _dot_results(lambda x, w: matmul("md,df->mf", x, w, jnp.bfloat16, jnp.float32), x, w) == ["16x8xf32"]
  dense = Dense(8, ("embed", "mlp"), dtype=jnp.bfloat16)
  params = dense.init(jax.random.key(0), x)
  assert _dot_results(lambda p, x: dense.apply(p, x), params, x) == ["16x8xbf16"]
  biased = Dense(8, ("embed", "mlp"), use_bias=True, dtype=jnp.bfloat16)
  params = biased.init(jax.random.key(0), x)
  assert _dot_results(lambda p, x: biased.apply(p, x), params, x) == ["16x8xf32"]  # the bias adds in f32


def test_matmul_rejects_what_its_backward_cannot_transpose():
  x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
  with pytest.raises(ValueError, match="explicit two-operand"):
    matmul("...d,df->...f", x, w, jnp.float32)
  with pytest.raises(ValueError, match="appears nowhere else"):
    matmul("md,de->m", x, w, jnp.float32)
  assert dense_apply(w, x, jnp.float32).shape == (4, 3)


def test_remat_dots_policy_saves_matmul_outputs(capsys):
  """model.remat=dots must keep nn.matmul's outputs, though their dots sit inside a custom VJP."""
  from jax.ad_checkpoint import print_saved_residuals

  from moejax.model import DOTS_POLICY

  def f(x, w1, w2):
    h = jnp.tanh(matmul("md,df->mf", x, w1, jnp.bfloat16))
    return jnp.sum(matmul("mf,fd->md", h, w2, jnp.bfloat16).astype(jnp.float32))

  x, w1, w2 = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 32)), jnp.ones((32, 16))
  print_saved_residuals(jax.checkpoint(f, policy=DOTS_POLICY), x, w1, w2)
  assert "bf16[8,32]" in capsys.readouterr().out  # the first matmul's output is kept
  # Without the name, the policy would see no dot and keep only the arguments.
  print_saved_residuals(jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable), x, w1, w2)
  assert "bf16[8,32]" not in capsys.readouterr().out


def _primitive_names(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitive_names(sub)
  return names


def test_remat_pieces_equals_one_pass_and_has_no_loop():
  """Values and gradients of the pieces equal the whole; the pieces stay unrolled (no scan or while: a
  scan's zero-filled buffers cost the 1M step 43 GiB on the H200), each one a remat."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(12, 5)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
  fn = lambda x_MD, w_DF: jnp.tanh(x_MD @ w_DF)
  pieces = lambda x, w: jnp.concatenate(remat_pieces(lambda x_: fn(x_, w), 4, x))
  whole = lambda x, w: fn(x, w)
  np.testing.assert_allclose(pieces(x, w), whole(x, w), rtol=1e-6)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  grads = [jax.grad(loss(f), (0, 1))(x, w) for f in (pieces, whole)]
  for got, want in zip(*grads, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  names = _primitive_names(jax.make_jaxpr(jax.grad(loss(pieces), (0, 1)))(x, w).jaxpr)
  assert "remat2" in names  # jax.checkpoint's primitive
  assert not names & {"scan", "while"}


def test_remat_pieces_needs_pieces_that_divide():
  with pytest.raises(ValueError, match="3 pieces need leading axes that they divide"):
    remat_pieces(jnp.sin, 3, jnp.ones((8, 2)))
  with pytest.raises(ValueError, match="need leading axes"):
    remat_pieces(lambda a, b: a + b, 2, jnp.ones((4,)), jnp.ones((6,)))
