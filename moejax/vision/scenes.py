"""Scenes drawn with Pillow, whose captions can be checked: one to three objects of one shape and colour, in
one half of the image.

  shape     circle, square, triangle
  colour    red, green, blue, yellow
  count     1, 2, 3
  position  left, right, top, bottom: the half of the image the objects lie in

A caption must get all four right, so a model has to see the image (not just guess the likeliest words) to
caption it, and every caption is checked by `scene_caption_correct` rather than compared word for word.

The drawing is exact, with no anti-aliasing: every pixel is the background or the objects' colour, the
objects never touch (at least _GAP pixels apart) nor cross the midline (at least _MARGIN pixels inside
their half), and each is at least MIN_OBJECT pixels across, so that it still covers a few 4x4 patches.
Width and height are drawn independently, so tall and wide images both appear.
"""

import re

import numpy as np
from PIL import Image, ImageDraw

from moejax.vision.examples import ImageText

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (235, 200, 20)}
COUNTS = (1, 2, 3)
POSITIONS = ("left", "right", "top", "bottom")
MIN_OBJECT = 6  # pixels across, at the least
MIN_SIDE = 24  # the smallest width or height at which three objects of MIN_OBJECT fit in a half
_GAP = 2  # empty pixels at least between two objects
_MARGIN = 1  # empty pixels at least between an object and the edges of its half
_BACKGROUND = (215, 250)  # range of the background's grey level, before a small tint per channel
_TINT = 6
_COUNT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_WHERE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}
_SPLIT_STREAMS = {"train": 0, "valid": 1}
_STREAM_TAG = 0x5CE7E5  # keeps these draws apart from anything else seeded with the same seed
_WORDS = re.compile(r"[0-9]+|[a-z]+")


def scene_caption(label: dict) -> str:
  """"two red circles on the left.", "one blue square at the top."."""
  count, shape = label["count"], label["shape"]
  shapes = shape if count == 1 else f"{shape}s"
  return f"{_COUNT_WORDS[count]} {label['colour']} {shapes} {_WHERE[label['position']]}."


def half_box(position: str, width: int, height: int) -> tuple[int, int, int, int]:
  """(x0, y0, x1, y1), ends excluded, of the pixels wholly inside that half; an odd side's middle row or
  column belongs to neither half."""
  if position == "left":
    return 0, 0, width // 2, height
  if position == "right":
    return width - width // 2, 0, width, height
  if position == "top":
    return 0, 0, width, height // 2
  if position == "bottom":
    return 0, height - height // 2, width, height
  raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")


def _slots(long: int, count: int) -> int:
  """The length along the long side that each object and its trailing gap get."""
  return (long - 2 * _MARGIN + _GAP) // count


def _largest_object(short: int, long: int, count: int) -> int:
  return min(short - 2 * _MARGIN, _slots(long, count) - _GAP)


def smallest_side(min_object: int) -> int:
  """The least width or height at which three objects of min_object pixels fit, with their gaps and
  margins, along the long side of a half (whose short side then has room for them too)."""
  return 3 * (min_object + _GAP)


def draw_scene(rng: np.random.Generator, *, min_side: int = 24, max_side: int = 48,
               min_object: int = MIN_OBJECT) -> ImageText:
  """One scene of random attributes and size (width and height each in [min_side, max_side]), captioned by
  scene_caption. The objects stand in a row along the longer side of their half, one in each equal slot,
  each at a random size (at least min_object pixels across) and place within its slot."""
  if min_object < MIN_OBJECT:
    raise ValueError(f"min_object={min_object} is below {MIN_OBJECT} pixels")
  if not smallest_side(min_object) <= min_side <= max_side:
    raise ValueError(f"need {smallest_side(min_object)} <= min_side <= max_side (three objects of "
                     f"{min_object} pixels must fit in half the image), got min_side={min_side}, "
                     f"max_side={max_side}")
  shape = SHAPES[int(rng.integers(len(SHAPES)))]
  colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
  count = COUNTS[int(rng.integers(len(COUNTS)))]
  position = POSITIONS[int(rng.integers(len(POSITIONS)))]
  width, height = (int(v) for v in rng.integers(min_side, max_side + 1, size=2))
  grey = int(rng.integers(_BACKGROUND[0], _BACKGROUND[1] + 1))
  background = tuple(int(min(255, grey + t)) for t in rng.integers(-_TINT, _TINT + 1, size=3))

  img = Image.new("RGB", (width, height), background)
  draw = ImageDraw.Draw(img)
  x0, y0, x1, y1 = half_box(position, width, height)
  along_x = (x1 - x0) > (y1 - y0) or ((x1 - x0) == (y1 - y0) and bool(rng.integers(2)))
  long, short = (x1 - x0, y1 - y0) if along_x else (y1 - y0, x1 - x0)
  largest = _largest_object(short, long, count)
  if largest < min_object:  # cannot happen for sides >= smallest_side; a guard against a changed constant
    raise ValueError(f"a {width}x{height} image has no room for {count} objects of {min_object} pixels")
  slot = _slots(long, count)
  spare = long - 2 * _MARGIN + _GAP - slot * count  # left over by the division: shifts the whole row
  start = _MARGIN + int(rng.integers(spare + 1))
  for k in range(count):
    size = int(rng.integers(min_object, largest + 1))
    a = start + k * slot + int(rng.integers(slot - _GAP - size + 1))
    b = _MARGIN + int(rng.integers(short - 2 * _MARGIN - size + 1))
    left, top = (x0 + a, y0 + b) if along_x else (x0 + b, y0 + a)
    _draw_shape(draw, shape, left, top, size, COLOURS[colour])
  label = {"shape": shape, "colour": colour, "count": count, "position": position}
  return ImageText(np.asarray(img, dtype=np.uint8), scene_caption(label), "scenes", label)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, left: int, top: int, size: int,
                fill: tuple[int, int, int]) -> None:
  right, bottom = left + size - 1, top + size - 1  # Pillow's boxes include their last pixel
  if shape == "circle":
    draw.ellipse((left, top, right, bottom), fill=fill)
  elif shape == "square":
    draw.rectangle((left, top, right, bottom), fill=fill)
  elif shape == "triangle":
    draw.polygon([(left, bottom), (right, bottom), (left + (size - 1) / 2, top)], fill=fill)
  else:
    raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")


def scene_at(split: str, index: int, *, seed: int = 0, min_side: int = 24, max_side: int = 48,
             min_object: int = MIN_OBJECT) -> ImageText:
  """Scene `index` of a split: drawn from a generator seeded by (split, seed, index) alone, so any scene
  can be drawn on demand, in any order (the training pipeline draws them as it reaches them)."""
  if split not in _SPLIT_STREAMS:
    raise ValueError(f"split must be one of {sorted(_SPLIT_STREAMS)}, got {split!r}")
  if index < 0 or seed < 0:
    raise ValueError(f"index and seed must be >= 0, got index={index}, seed={seed}")
  rng = np.random.default_rng([_STREAM_TAG, seed, _SPLIT_STREAMS[split], int(index)])
  return draw_scene(rng, min_side=min_side, max_side=max_side, min_object=min_object)


def scene_examples(split: str, n: int, *, seed: int = 0, min_side: int = 24, max_side: int = 48,
                   min_object: int = MIN_OBJECT) -> list[ImageText]:
  """Scenes 0..n-1 of the split (`scene_at`); "train" and "valid" draw from different seed streams."""
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  return [scene_at(split, i, seed=seed, min_side=min_side, max_side=max_side, min_object=min_object)
          for i in range(n)]


def scene_caption_correct(text: str, label: dict) -> bool:
  """Right when the caption states each attribute, and only the right value of it: "two red circles on the
  left." and "2 red circle, left" are right for two red circles on the left; "two red or blue circles on the
  left." is not, nor is one that leaves out the position. Shapes may be singular or plural, the count a
  numeral or a number word; any other number stated ("four", "12") is a wrong count."""
  stated: dict[str, set] = {"shape": set(), "colour": set(), "count": set(), "position": set()}
  for word in _WORDS.findall(text.lower()):
    if word.isdigit():
      stated["count"].add(int(word))
    elif word in _COUNT_WORDS:
      stated["count"].add(_COUNT_WORDS.index(word))
    elif word in COLOURS:
      stated["colour"].add(word)
    elif word in POSITIONS:
      stated["position"].add(word)
    elif word in SHAPES or (word.endswith("s") and word[:-1] in SHAPES):
      stated["shape"].add(word.removesuffix("s"))
  return all(values == {label[attribute]} for attribute, values in stated.items())
