"""Generation with images against the plain forward pass: greedy tokens after an image prompt are the
argmax of the full forward over the growing row with the image in place, whatever the prefill pieces."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.data.tokenizer import BOS_ID, IMAGE_ID
from moejax.inference import Conversation, generate, random_model
from moejax.model import Transformer
from moejax.vision.batch import pack_images
from moejax.vision.prompts import expand_placeholders
from tests.vision.test_encoder import PATCH, vision_config


@pytest.fixture(scope="module")
def lm():
  return random_model(vision_config(), seed=3)


def _reference(lm, prompt, images, n):
  """n greedy tokens from full forward passes (tokens and images in place, no cache)."""
  tokens, encoded = expand_placeholders(lm.config, prompt, images)
  patches, ids, coords = pack_images(encoded, 64, PATCH * PATCH * 3)
  im = {"patches": jnp.asarray(patches)[None], "ids": jnp.asarray(ids)[None],
        "coords": jnp.asarray(coords)[None]}

  @jax.jit
  def last_logits(row):
    h = lm.model.apply(lm.variables, row, images=im)[0]
    return lm.model.apply(lm.variables, h, method=Transformer.logits)[0, -1]

  row, out = list(tokens), []
  for _ in range(n):
    out.append(int(jnp.argmax(last_logits(jnp.asarray([row])))))
    row.append(out[-1])
  return out


def test_greedy_with_images_is_the_argmax_of_the_full_forward(lm):
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((8, 16, 3), (16, 8, 3))]
  prompts = [[BOS_ID, IMAGE_ID, 40, 41], [BOS_ID, 50, IMAGE_ID]]
  out = generate(lm, prompts, images=[[images[0]], [images[1]]], max_new_tokens=5)
  for prompt, image, got in zip(prompts, images, out.tokens, strict=True):
    assert got == _reference(lm, prompt, [image], 5)


def test_images_prefilled_in_pieces_give_the_same_tokens(lm):
  rng = np.random.default_rng(1)
  image = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)  # 9 tokens: crosses pieces of 16
  prompt = [BOS_ID] + list(range(60, 70)) + [IMAGE_ID] + [71, 72]
  whole = generate(lm, [prompt], images=[[image]], max_new_tokens=4).tokens[0]
  lm_small = dataclasses.replace(lm, prefill_chunk=16)
  pieces = generate(lm_small, [prompt], images=[[image]], max_new_tokens=4).tokens[0]
  assert whole == pieces == _reference(lm, prompt, [image], 4)


def test_image_counts_must_match_placeholders(lm):
  image = np.zeros((8, 8, 3), np.uint8)
  with pytest.raises(ValueError, match="1 image placeholders .* given 2 images"):
    generate(lm, [[BOS_ID, IMAGE_ID]], images=[[image, image]], max_new_tokens=2)
  with pytest.raises(ValueError, match="one per row"):
    Conversation(lm, 2).turn([[BOS_ID], [BOS_ID]], images=[[image]], max_new_tokens=2)
  with pytest.raises(ValueError, match="no images were given"):
    generate(lm, [[BOS_ID, IMAGE_ID]], max_new_tokens=2)
