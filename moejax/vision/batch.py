"""What a batch carries for its images, beside the text's tokens/targets/segment_ids/loss_mask:

  image_patches [B, N, p*p*3] uint8  the patches of the images packed into each row (moejax.vision.patches)
  image_ids     [B, N] int32         1, 2, ... per image of the row, 0 on padding patches
  image_coords  [B, N, 4] int32      each patch's (row, col, grid height, grid width)

and the model's `images=` argument is the same three arrays under the short names.
"""

import numpy as np

IMAGE_KEYS = {"image_patches": "patches", "image_ids": "ids", "image_coords": "coords"}


def images_of(batch: dict) -> dict | None:
  """The model's `images` argument from a batch: None for a text-only batch."""
  present = [k for k in IMAGE_KEYS if k in batch]
  if not present:
    return None
  if len(present) != len(IMAGE_KEYS):
    raise ValueError(f"a batch with images needs all of {sorted(IMAGE_KEYS)}, got {sorted(present)}")
  return {short: batch[key] for key, short in IMAGE_KEYS.items()}


def pack_images(encoded: list, capacity: int, patch_values: int):
  """(patches uint8 [capacity, patch_values], ids int32 [capacity], coords int32 [capacity, 4]) of one
  row's images, each given as (patches, coords) from `moejax.vision.patches.patchify`, in order; image k
  gets id k + 1, and the patches past the last image are padding (id 0)."""
  total = sum(len(p) for p, _ in encoded)
  if total > capacity:
    raise ValueError(f"{total} patches do not fit a row of {capacity}")
  patches = np.zeros((capacity, patch_values), np.uint8)
  ids, coords = np.zeros(capacity, np.int32), np.zeros((capacity, 4), np.int32)
  start = 0
  for k, (p, c) in enumerate(encoded, start=1):
    patches[start:start + len(p)], coords[start:start + len(p)], ids[start:start + len(p)] = p, c, k
    start += len(p)
  return patches, ids, coords
