"""Prompts with images for generation: one IMAGE placeholder per image in the text's tokens, expanded to
that image's number of tokens, as the training rows hold them (moejax.vision.pipeline)."""

import numpy as np

from moejax.data.tokenizer import IMAGE_ID
from moejax.vision.config import image_pixel_cap
from moejax.vision.patches import patchify


def expand_placeholders(config, tokens: list[int], images: list) -> tuple[list[int], list[tuple]]:
  """(tokens with the k-th IMAGE_ID repeated as many times as image k has tokens, [(patches, coords)] of
  the images) for one row. `images` are RGB uint8 [H, W, 3] arrays, one per placeholder, in order."""
  v = config.model.vision
  found = sum(1 for t in tokens if t == IMAGE_ID)
  if found != len(images):
    raise ValueError(f"a prompt with {found} image placeholders (token {IMAGE_ID}) is given {len(images)} "
                     "images: put one placeholder where each image goes")
  if images and not v.enabled:
    raise ValueError("this model has no vision tower (model.vision.enabled is False): it takes no images")
  cap = image_pixel_cap(config)
  encoded = [patchify(np.asarray(im), patch=v.patch_size, merge=v.merge, max_pixels=cap) for im in images]
  out, k = [], 0
  for t in tokens:
    if t == IMAGE_ID:
      out += [IMAGE_ID] * (len(encoded[k][0]) // (v.merge * v.merge))
      k += 1
    else:
      out.append(int(t))
  return out, encoded
