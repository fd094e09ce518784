"""Decoding images with Pillow into uint8 RGB arrays, and counting the ones that are skipped.

Real image collections always hold some files that cannot be used: cut short by a failed copy, empty,
gone, or far too large (by accident or as a decompression bomb: a few kilobytes of PNG that decode to
gigabytes). Such an image raises `BadImage` with one of four reasons, and the reader that meets it skips
it through a `SkipLog`, which counts and logs it: a training run must neither crash on the millionth file
nor silently lose a tenth of its data.

The size is checked from the header, before a single pixel is decoded. Pillow's own bomb limit
(`PIL.Image.MAX_IMAGE_PIXELS`, read, never changed here) applies too: an image above it is oversized
whatever `max_decode_pixels` says. Pillow also issues a DecompressionBombWarning for such an image as it
reads the header; that warning is left to the warnings filters, since changing them here would not be
thread-safe.
"""

import io
import logging
from collections import Counter

import fsspec
import numpy as np
from PIL import Image, ImageOps

REASONS = ("corrupt", "empty", "oversized", "missing")
# What a SkipLog counts: bad images, and image-text examples too long for a training row.
SKIP_REASONS = (*REASONS, "too long")
# 16-bit greys (16-bit PNG, TIFF) are scaled to 8 bits; Pillow's own conversion would clip them to 255.
_SIXTEEN_BIT_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})

log = logging.getLogger("moejax.vision")


class BadImage(ValueError):
  """An image that cannot be used; `reason` is one of REASONS, `detail` says what was wrong."""

  def __init__(self, reason: str, detail: str):
    if reason not in REASONS:
      raise ValueError(f"unknown BadImage reason {reason!r}; expected one of {REASONS}")
    super().__init__(f"{reason} image: {detail}")
    self.reason = reason
    self.detail = detail


def decode_image(data: bytes, *, max_decode_pixels: int) -> np.ndarray:
  """Decodes any format Pillow reads (the first frame of an animation) into uint8 [H, W, 3] RGB, turned
  upright as its EXIF orientation says. Transparency is composited on white; palette, grey, CMYK and 16-bit
  images are converted. Raises BadImage: "empty" (no bytes, or no pixels), "oversized" (more than
  max_decode_pixels, or than Pillow's bomb limit, found from the header alone), "corrupt" (anything else
  Pillow cannot decode, truncated files included: the pixels are all loaded here, not later)."""
  if max_decode_pixels < 1:
    raise ValueError(f"max_decode_pixels must be >= 1, got {max_decode_pixels}")
  if not data:
    raise BadImage("empty", "no bytes")
  try:
    img = Image.open(io.BytesIO(data))  # reads the header only
  except Image.DecompressionBombError as e:
    raise BadImage("oversized", str(e)) from None
  except Exception as e:  # Pillow raises many types for bytes it cannot parse (OSError, SyntaxError, ...)
    raise BadImage("corrupt", f"Pillow cannot identify it ({type(e).__name__}: {e})") from None
  width, height = img.size
  pixels = width * height
  if pixels == 0:
    raise BadImage("empty", f"{width}x{height} pixels")
  pillow_limit = Image.MAX_IMAGE_PIXELS
  if pixels > max_decode_pixels:
    raise BadImage("oversized", f"{width}x{height} = {pixels} pixels, more than max_decode_pixels="
                   f"{max_decode_pixels}")
  if pillow_limit is not None and pixels > pillow_limit:
    raise BadImage("oversized", f"{width}x{height} = {pixels} pixels, more than Pillow's MAX_IMAGE_PIXELS="
                   f"{pillow_limit}")
  try:
    img.load()  # every pixel now, so that a truncated file fails here
    img = ImageOps.exif_transpose(img)
    return _to_rgb(img)
  except Image.DecompressionBombError as e:
    raise BadImage("oversized", str(e)) from None
  except Exception as e:
    raise BadImage("corrupt", f"{img.format} {width}x{height} does not decode "
                   f"({type(e).__name__}: {e})") from None


def _to_rgb(img: Image.Image) -> np.ndarray:
  if img.mode in _SIXTEEN_BIT_MODES:
    grey = np.asarray(img).astype(np.int64)
    grey = (np.clip(grey, 0, 65535) * 255 + 32767) // 65535
    return np.repeat(grey.astype(np.uint8)[:, :, None], 3, axis=2)
  has_alpha = "A" in img.getbands() or "a" in img.getbands() or "transparency" in img.info
  if has_alpha:
    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    img = Image.alpha_composite(white, rgba)
  rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
  if rgb.ndim != 3 or rgb.shape[2] != 3:
    raise ValueError(f"mode {img.mode} converted to shape {rgb.shape}, not [H, W, 3]")
  return np.ascontiguousarray(rgb)


def read_image(path: str, *, max_decode_pixels: int) -> np.ndarray:
  """Reads a local path or fsspec URL and decodes it (decode_image); BadImage("missing") if there is
  nothing at that path."""
  try:
    with fsspec.open(path, "rb") as f:
      data = f.read()
  except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
    raise BadImage("missing", f"{path!r} ({type(e).__name__}: {e})") from None
  try:
    return decode_image(data, max_decode_pixels=max_decode_pixels)
  except BadImage as e:
    raise BadImage(e.reason, f"{path!r}: {e.detail}") from None


class SkipLog:
  """Counts skipped images by reason, and logs a warning for each (logger "moejax.vision") with where it
  was and how many of that reason there have been so far. One per reader, so that its counts can be
  reported at the end of a pass."""

  def __init__(self):
    self._counts: Counter[str] = Counter()

  def skip(self, reason: str, where: str) -> None:
    if reason not in SKIP_REASONS:
      raise ValueError(f"unknown skip reason {reason!r}; expected one of {SKIP_REASONS}")
    self._counts[reason] += 1
    log.warning("skipped %s %s at %s (%d %s so far)", reason, "example" if reason == "too long" else "image",
                where, self._counts[reason], reason)

  def counts(self) -> dict[str, int]:
    return dict(self._counts)

  @property
  def total(self) -> int:
    return sum(self._counts.values())
