"""Handwritten digits: scikit-learn's bundled set of 1,797 real 8x8 scans, read offline from the package.

The scans are greys 0..16 (16 = full ink). They are drawn here as dark ink on a light background (0 ink is
white, 255; full ink is black, 0), the way a digit on paper looks, upscaled bilinearly with Pillow to
size x size RGB: small enough to learn in minutes, real enough that captioning them is not a lookup.

The split is fixed by a hash of each scan's index, not by its position: scikit-learn's rows come in
writer order, so holding out the last rows would hold out writers, not a sample.
"""

import hashlib
import re

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from moejax.vision.examples import ImageText

DIGIT_COUNT = 1797
VALID_PERCENT = 15  # of the scans, held out as "valid"
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_SCAN_MAX = 16  # ink level of a fully dark scan pixel
_MENTIONS = re.compile(r"[0-9]+|[a-z]+")


def digit_split(index: int) -> str:
  """"train" or "valid" for the scan at `index` of scikit-learn's order: a fixed hash, the same on every
  machine and Python (unlike hash(), which is salted per process)."""
  h = int.from_bytes(hashlib.sha256(f"moejax.digits:{index}".encode()).digest()[:8], "little")
  return "valid" if h % 100 < VALID_PERCENT else "train"


def digit_image(scan: np.ndarray, size: int) -> np.ndarray:
  """An 8x8 scan of 0..16 as uint8 [size, size, 3]: dark ink (0) on a light background (255)."""
  if scan.shape != (8, 8):
    raise ValueError(f"a digit scan is 8x8, got shape {scan.shape}")
  grey = np.rint(255.0 - np.clip(scan, 0, _SCAN_MAX) * (255.0 / _SCAN_MAX)).astype(np.uint8)
  img = Image.fromarray(grey, mode="L").resize((size, size), Image.Resampling.BILINEAR)
  return np.asarray(img.convert("RGB"), dtype=np.uint8)


def digit_caption(digit: int) -> str:
  """"a handwritten 7.": the digit as one numeral."""
  if not 0 <= digit <= 9:
    raise ValueError(f"a digit is 0..9, got {digit}")
  return f"a handwritten {digit}."


def digit_examples(split: str, *, size: int = 16) -> list[ImageText]:
  """The scans of the split ("train", about 85%, or "valid"), in scikit-learn's order, captioned."""
  if split not in ("train", "valid"):
    raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
  if size < 1:
    raise ValueError(f"size must be >= 1 pixel, got {size}")
  data = load_digits()
  if len(data.images) != DIGIT_COUNT:
    raise ValueError(f"scikit-learn's digits have {len(data.images)} scans, expected {DIGIT_COUNT}")
  pairs = enumerate(zip(data.images, data.target, strict=True))
  return [ImageText(digit_image(scan, size), digit_caption(int(d)), "digits", {"digit": int(d)})
          for i, (scan, d) in pairs if digit_split(i) == split]


def digit_caption_correct(text: str, label: dict) -> bool:
  """Right when the caption names a digit, as a numeral ("7") or a word ("seven", any case), and every digit
  it names is label["digit"]: "a handwritten 7 or 1." names two and is wrong, and so is "17", which is not a
  digit at all."""
  want = label["digit"]
  named = set()
  for mention in _MENTIONS.findall(text.lower()):
    if mention.isdigit():
      named.add(int(mention))  # "17" is 17, not a digit: never the label
    elif mention in NUMBER_WORDS:
      named.add(NUMBER_WORDS.index(mention))
  return named == {want}
