"""The vision tower: patches and their coordinates, the interpolated position table, 2D RoPE, the encoder
over packed images against each image alone, and the decoder reading images causally."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import example, given, settings

from moejax.config import base_config, validate
from moejax.data.tokenizer import BOS_ID, IMAGE_ID
from moejax.model import build_model, init_variables
from moejax.vision.batch import pack_images
from moejax.vision.encoder import VisionEncoder, place_images
from moejax.vision.patches import fitted_size, patchify
from moejax.vision.positions import interpolated_positions, rope_2d
from moejax.vision.prompts import expand_placeholders

PATCH, MERGE = 4, 2


def vision_config(attention="xla"):
  """A small decoder with a vision tower, float32, XLA paths."""
  c = base_config()
  c.data.vocab_size, c.data.image_token = 300, True
  c.data.images.source, c.data.images.patches_per_row = "embedded", 64
  m = c.model
  m.update(num_layers=2, layer_pattern="KM", num_dense_layers=1, d_model=32)
  m.kda.update(num_heads=2, head_k_dim=16, head_v_dim=16, gate_rank=8, chunk_size=16, implementation="xla",
               conv_implementation="xla")
  m.mla.update(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
               attention="xla")
  m.attnres.block_size = 2
  m.ffn.hidden_dim = 48
  m.vision.update(enabled=True, patch_size=PATCH, merge=MERGE, max_pixels=32 * 32, width=32, depth=2,
                  num_heads=2, mlp_dim=48, position_grid=6, attention=attention)
  c.train.stages = ((64, 1, 64),)
  return validate(c)


def _image(rng, h, w):
  return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_patchify_lists_merge_blocks_with_their_coordinates():
  rng = np.random.default_rng(0)
  img = _image(rng, 16, 24)  # already whole merge blocks: no resize
  patches, coords = patchify(img, patch=PATCH, merge=MERGE, max_pixels=10_000)
  gh, gw = 4, 6
  assert patches.shape == (gh * gw, PATCH * PATCH * 3) and coords.shape == (gh * gw, 4)
  assert set(map(tuple, coords[:, 2:])) == {(gh, gw)}
  for (r, c, _, _), p in zip(coords, patches, strict=True):  # each patch is the pixels at its cell
    np.testing.assert_array_equal(p, img[r * PATCH:(r + 1) * PATCH, c * PATCH:(c + 1) * PATCH].reshape(-1))
  # Every run of merge^2 patches is one merge block, row-major inside it.
  for b in range(0, len(coords), MERGE * MERGE):
    rows, cols = coords[b:b + 4, 0], coords[b:b + 4, 1]
    assert list(rows - rows[0]) == [0, 0, 1, 1] and list(cols - cols[0]) == [0, 1, 0, 1]
    assert rows[0] % MERGE == 0 and cols[0] % MERGE == 0


@given(st.integers(1, 3000), st.integers(1, 3000), st.sampled_from([14, 16]), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
@example(190, 526, 14, 3)  # both sides round up past the cap
@example(106, 925, 14, 3)  # only the short side rounds up: it is the one to give a unit back
def test_fitted_size_keeps_native_size_and_aspect_under_the_cap(h, w, patch, merge):
  unit = patch * merge
  cap = 64 * unit * unit
  H, W = fitted_size(h, w, patch=patch, merge=merge, max_pixels=cap)
  assert H % unit == 0 and W % unit == 0 and H >= unit and W >= unit and H * W <= cap
  if h * w <= cap and h >= unit and w >= unit:  # small enough: the size is kept, to the nearest unit ...
    nearest = round(h / unit) * round(w / unit) * unit * unit <= cap
    # ... unless rounding both sides up crosses the cap (h=190, w=526 at unit 42: 5 x 13 units > 64):
    # then a side loses a unit, and stays within one unit of its size.
    slack = unit / 2 if nearest else unit
    assert abs(H - h) <= slack and abs(W - w) <= slack


@given(st.integers(1, 14), st.integers(1, 14), st.integers(2, 9))
@settings(max_examples=12, deadline=None)
def test_position_interpolation_is_scale_and_translate_without_antialiasing(gh, gw, side):
  table = jax.random.normal(jax.random.key(gh * 100 + gw), (side, side, 5))
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
  coords = np.stack([rows.ravel(), cols.ravel(), np.full(gh * gw, gh), np.full(gh * gw, gw)], 1)
  got = jax.jit(interpolated_positions)(table, jnp.asarray(coords)).reshape(gh, gw, 5)
  scale = jnp.array([gh / side, gw / side])
  want = jax.jit(lambda t: jax.image.scale_and_translate(t, (gh, gw, 5), (0, 1), scale, jnp.zeros(2), "cubic",
                                                         antialias=False))(table)
  chex.assert_trees_all_close(got, want, atol=1e-5)


def test_position_interpolation_gradients_are_those_of_scale_and_translate():
  side, gh, gw = 5, 7, 3
  table = jax.random.normal(jax.random.key(1), (side, side, 4), jnp.float32)
  weights = jax.random.normal(jax.random.key(2), (gh, gw, 4), jnp.float32)
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
  coords = jnp.asarray(np.stack([rows.ravel(), cols.ravel(), np.full(gh * gw, gh), np.full(gh * gw, gw)], 1))
  ours = jax.grad(lambda t: jnp.sum(weights * interpolated_positions(t, coords).reshape(gh, gw, 4)))(table)
  scale = jnp.array([gh / side, gw / side])
  theirs = jax.grad(lambda t: jnp.sum(weights * jax.image.scale_and_translate(
      t, (gh, gw, 4), (0, 1), scale, jnp.zeros(2), "cubic", antialias=False)))(table)
  chex.assert_trees_all_close(ours, theirs, atol=1e-5)


def test_position_interpolation_on_the_tables_own_grid_is_the_identity():
  side = 7
  table = jax.random.normal(jax.random.key(0), (side, side, 3))
  rows, cols = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
  coords = np.stack([rows.ravel(), cols.ravel(), np.full(side * side, side), np.full(side * side, side)], 1)
  np.testing.assert_array_equal(interpolated_positions(table, jnp.asarray(coords)), table.reshape(-1, 3))


def test_rope_2d_scores_depend_on_offsets_only():
  key = jax.random.split(jax.random.key(0), 2)
  q, k = jax.random.normal(key[0], (1, 1, 16)), jax.random.normal(key[1], (1, 1, 16))
  score = lambda pq, pk: float(jnp.sum(rope_2d(q, jnp.array([pq[0]]), jnp.array([pq[1]]), 100.0)
                                       * rope_2d(k, jnp.array([pk[0]]), jnp.array([pk[1]]), 100.0)))
  np.testing.assert_allclose(score((3, 5), (1, 2)), score((10, 7), (8, 4)), rtol=1e-5)
  assert abs(score((3, 5), (1, 2)) - score((3, 5), (2, 1))) > 1e-4  # rows and columns are told apart


def _encoder(cfg):
  v = ml_collections.FrozenConfigDict(cfg.model.vision)
  return VisionEncoder(v, cfg.model.d_model)


@pytest.mark.parametrize("attention", ["xla", "interpret"])
def test_encoder_over_packed_images_equals_each_image_alone(attention):
  cfg = vision_config(attention)
  enc = _encoder(cfg)
  rng = np.random.default_rng(1)
  sizes = [(8, 8), (16, 8), (8, 24), (24, 16)]  # several resolutions and aspect ratios
  encoded = [patchify(_image(rng, h, w), patch=PATCH, merge=MERGE, max_pixels=1024) for h, w in sizes]
  total = sum(len(p) for p, _ in encoded)
  capacity = total + 8  # and padding after the last image
  patches, ids, coords = (jnp.asarray(x)[None] for x in pack_images(encoded, capacity, PATCH * PATCH * 3))
  params = jax.jit(enc.init)(jax.random.key(0), patches, ids, coords)
  apply = jax.jit(enc.apply)
  packed = apply(params, patches, ids, coords)[0]

  def image_loss(q, inputs, w, start, n):
    return jnp.sum(w * apply(q, *inputs)[0, start:start + n])

  start = 0
  for p, c in encoded:
    alone_inputs = [jnp.asarray(x)[None] for x in pack_images([(p, c)], len(p), p.shape[1])]
    alone = apply(params, *alone_inputs)[0]
    n = len(p) // (MERGE * MERGE)
    chex.assert_trees_all_close(packed[start:start + n], alone, atol=2e-5, rtol=2e-5)
    # Gradients too: a loss on this image's tokens gets the same parameter gradient packed as alone.
    w = jax.random.normal(jax.random.key(start), alone.shape)
    grad_packed = jax.grad(image_loss)(params, (patches, ids, coords), w, start, n)
    grad_alone = jax.grad(image_loss)(params, alone_inputs, w, 0, n)
    chex.assert_trees_all_close(grad_packed, grad_alone, atol=1e-4, rtol=1e-4)
    start += n


def test_place_images_fills_placeholders_in_order():
  x = jnp.zeros((2, 6, 3))
  tokens = jnp.array([[BOS_ID, IMAGE_ID, IMAGE_ID, 9, IMAGE_ID, 9], [BOS_ID, 9, 9, 9, 9, 9]])
  image_tokens = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3) + 1
  out = place_images(x, tokens, image_tokens, IMAGE_ID)
  np.testing.assert_array_equal(out[0, 1], image_tokens[0, 0])
  np.testing.assert_array_equal(out[0, 2], image_tokens[0, 1])
  np.testing.assert_array_equal(out[0, 4], image_tokens[0, 2])
  np.testing.assert_array_equal(out[0, [0, 3, 5]], 0)
  np.testing.assert_array_equal(out[1], 0)


def test_expand_placeholders_counts_each_images_tokens():
  cfg = vision_config()
  rng = np.random.default_rng(2)
  images = [_image(rng, 8, 8), _image(rng, 16, 24)]  # 4 and 24 patches: 1 and 6 merged tokens
  tokens, encoded = expand_placeholders(cfg, [BOS_ID, IMAGE_ID, 7, IMAGE_ID, 8], images)
  assert tokens == [BOS_ID, IMAGE_ID, 7] + [IMAGE_ID] * 6 + [8]
  assert [len(p) for p, _ in encoded] == [4, 24]
  with pytest.raises(ValueError, match="2 image placeholders .* given 1 images"):
    expand_placeholders(cfg, [BOS_ID, IMAGE_ID, IMAGE_ID], images[:1])


def test_text_after_an_image_sees_it_and_text_before_does_not():
  cfg = vision_config()
  model = build_model(cfg)
  variables = init_variables(model, jax.random.key(0))
  rng = np.random.default_rng(3)
  before, after = [BOS_ID, 11, 12, 13], [14, 15, 16]

  forward = jax.jit(lambda t, im: model.apply(variables, t, images=im, mutable=["router"])[0][0][0])

  def hidden(image):
    tokens, encoded = expand_placeholders(cfg, before + [IMAGE_ID] + after, [image])
    patches, ids, coords = pack_images(encoded, 16, PATCH * PATCH * 3)
    images = {"patches": jnp.asarray(patches)[None], "ids": jnp.asarray(ids)[None],
              "coords": jnp.asarray(coords)[None]}
    return forward(jnp.asarray([tokens]), images), tokens

  h1, tokens = hidden(_image(rng, 8, 16))
  h2, _ = hidden(_image(rng, 8, 16))
  n_before = len(before)
  np.testing.assert_array_equal(h1[:n_before], h2[:n_before])  # causal: the image is not seen before it
  assert float(jnp.max(jnp.abs(h1[-len(after):] - h2[-len(after):]))) > 1e-4


def test_a_model_without_a_tower_refuses_images():
  cfg = vision_config()
  cfg.model.vision.enabled, cfg.data.images.source = False, ""
  with pytest.raises(ValueError, match="no vision tower"):
    expand_placeholders(cfg, [BOS_ID, IMAGE_ID], [np.zeros((8, 8, 3), np.uint8)])


@pytest.mark.parametrize("change, message", [
    (lambda c: c.data.update(image_token=False), "data.image_token=True"),
    (lambda c: c.data.images.update(source=""), "needs data.images.source"),
    (lambda c: c.data.images.update(patches_per_row=30), "multiple of merge"),
    (lambda c: c.model.vision.update(num_heads=3), "heads of a multiple of 4"),
    (lambda c: c.model.vision.update(max_pixels=10), "below one merged patch"),
    (lambda c: c.model.vision.update(attention="flash"), "model.vision.attention"),
    (lambda c: c.model.vision.update(enabled=False), "no tower to read the images"),
    (lambda c: c.data.images.update(scene_min_object=8), "scene_min_side=24 must be >= 30"),
    (lambda c: c.train.update(stages=((16, 1, 16),)), "rows of 16 tokens cannot hold the largest image"),
])
def test_bad_vision_configs_name_their_field(change, message):
  from moejax.errors import ConfigError

  cfg = vision_config()
  change(cfg)
  with pytest.raises(ConfigError, match=message):
    validate(cfg)


def test_params_list_the_tower_and_its_projector():
  from moejax.params import count_params

  cfg = vision_config()
  components = count_params(cfg)["components"]
  v, D = cfg.model.vision, cfg.model.d_model
  W, M, P = v.width, v.mlp_dim, v.patch_size * v.patch_size * 3
  block = 4 * W + 4 * (W * W + W) + (W * M + M) + (M * W + W)  # 2 LayerNorms, q/k/v/out, MLP
  tower = (P * W + W) + v.position_grid ** 2 * W + v.depth * block + 2 * W
  projector = 2 * 4 * W + (4 * W * D + D) + (D * D + D)  # norm, in (hidden = d_model), out
  assert components["vision tower"] == (tower, tower)
  assert components["vision projector"] == (projector, projector)
