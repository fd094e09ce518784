"""Images to patches at native resolution and aspect ratio.

An image keeps its size unless it is larger than `max_pixels`, which scales it down with its aspect
ratio kept; either way each side is then rounded to a multiple of patch x merge (the patch merger joins
merge x merge neighbours), so a resize changes the aspect ratio by at most one merged patch per side.

Patches are listed merge block by merge block: the merge x merge patches of one block are consecutive
(row-major inside the block, blocks row-major over the image), so merging is a reshape. `coords` gives
each patch's (row, col) on the image's patch grid and the grid's (height, width), which is all the
encoder needs to place it (interpolated position table, 2D RoPE).
"""

import math

import numpy as np
from PIL import Image


def fitted_size(height: int, width: int, *, patch: int, merge: int, max_pixels: int) -> tuple[int, int]:
  """(height, width) in pixels that the image is resized to: at most max_pixels (aspect kept), each side a
  multiple of patch * merge and at least one merged patch."""
  if min(height, width) < 1:
    raise ValueError(f"an image needs at least one pixel a side, got {height}x{width}")
  unit = patch * merge
  if max_pixels < unit * unit:
    raise ValueError(f"max_pixels={max_pixels} is below one merged patch ({unit}x{unit} pixels)")
  scale = min(1.0, math.sqrt(max_pixels / (height * width)))
  target_h, target_w = height * scale / unit, width * scale / unit  # in units, within the cap
  h, w = max(1, round(target_h)), max(1, round(target_w))
  # Rounding up may cross the cap: take a unit off the side that rounding raised most (the longer one
  # on a tie). Down to its floor, each side stays within a unit of its target, and the floors fit.
  while h * w * unit * unit > max_pixels:
    if w == 1 or (h > 1 and (h - target_h, h) >= (w - target_w, w)):
      h -= 1
    else:
      w -= 1
  return h * unit, w * unit


def num_patches(height: int, width: int, *, patch: int, merge: int, max_pixels: int) -> int:
  h, w = fitted_size(height, width, patch=patch, merge=merge, max_pixels=max_pixels)
  return (h // patch) * (w // patch)


def patchify(image_HWC: np.ndarray, *, patch: int, merge: int, max_pixels: int):
  """(patches uint8 [N, patch*patch*3], coords int32 [N, 4] = (row, col, grid height, grid width)) of an
  RGB uint8 image, resized by `fitted_size` (bicubic) where its size is not already right."""
  if image_HWC.dtype != np.uint8 or image_HWC.ndim != 3 or image_HWC.shape[-1] != 3:
    raise ValueError(f"want an RGB uint8 [H, W, 3] image, got {image_HWC.dtype}{image_HWC.shape}")
  H, W = fitted_size(*image_HWC.shape[:2], patch=patch, merge=merge, max_pixels=max_pixels)
  if (H, W) != image_HWC.shape[:2]:
    image_HWC = np.asarray(Image.fromarray(image_HWC).resize((W, H), Image.Resampling.BICUBIC))
  gh, gw = H // patch, W // patch
  # [block row, merge row, patch row px, block col, merge col, patch col px, C] -> blocks, then patches
  x = image_HWC.reshape(gh // merge, merge, patch, gw // merge, merge, patch, 3)
  x = x.transpose(0, 3, 1, 4, 2, 5, 6).reshape(gh * gw, patch * patch * 3)
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
  order = lambda a: a.reshape(gh // merge, merge, gw // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
  coords = np.stack([order(rows), order(cols), np.full(gh * gw, gh), np.full(gh * gw, gw)], axis=1)
  return np.ascontiguousarray(x), coords.astype(np.int32)


def merged_tokens(num_image_patches: int, merge: int) -> int:
  """How many decoder tokens an image of this many patches becomes."""
  return num_image_patches // (merge * merge)
