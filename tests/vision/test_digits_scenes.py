"""Digits and scenes: the digit splits cover scikit-learn's 1,797 scans once each, every digit in both, drawn
as dark ink on light; the scenes are checked from their pixels (the stated colour, in the stated half, as
many separate blobs as the count, of the stated shape); captions are accepted by their checkers and any
single wrong attribute or extra value is rejected; the same seed gives the same scenes, the splits differ."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import ndimage
from sklearn.datasets import load_digits

from moejax.vision.digits import (
  DIGIT_COUNT,
  digit_caption,
  digit_caption_correct,
  digit_examples,
  digit_split,
)
from moejax.vision.scenes import (
  COLOURS,
  COUNTS,
  MIN_OBJECT,
  POSITIONS,
  SHAPES,
  draw_scene,
  scene_caption,
  scene_caption_correct,
  scene_examples,
  smallest_side,
)

# --- digits ---


@pytest.fixture(scope="module")
def digit_splits():
  return {split: digit_examples(split) for split in ("train", "valid")}


def test_digit_splits_partition_the_scans(digit_splits):
  train, valid = digit_splits["train"], digit_splits["valid"]
  assert len(train) + len(valid) == DIGIT_COUNT == 1797
  assert 0.12 < len(valid) / DIGIT_COUNT < 0.18
  keys = {split: {ex.image.tobytes() for ex in examples} for split, examples in digit_splits.items()}
  assert not keys["train"] & keys["valid"]
  assert len(keys["train"] | keys["valid"]) == DIGIT_COUNT  # the 1,797 scans are all different
  for examples in (train, valid):
    assert {ex.label["digit"] for ex in examples} == set(range(10))
    assert all(ex.kind == "digits" and ex.image.shape == (16, 16, 3) for ex in examples)
  # Held out by a hash of the index, not a block of rows at either end.
  held = [i for i in range(DIGIT_COUNT) if digit_split(i) == "valid"]
  assert len(held) == len(valid)
  assert held[0] < 50 and held[-1] > DIGIT_COUNT - 50 and max(np.diff(held)) < 60


def test_digits_are_the_scans_as_dark_ink_on_light():
  scans = load_digits()
  held = [i for i in range(DIGIT_COUNT) if digit_split(i) == "valid"]
  small = digit_examples("valid", size=8)  # no resampling at 8x8: the scan itself
  for ex, i in zip(small, held, strict=True):
    want = np.rint(255 - scans.images[i] * 255 / 16)
    np.testing.assert_array_equal(ex.image, np.repeat(want[:, :, None], 3, axis=2))
    assert ex.label["digit"] == scans.target[i]
  for ex in digit_examples("valid", size=28):
    assert ex.image.shape == (28, 28, 3)
    # Light paper with dark ink: a good part near white, some nearly black, light on average.
    assert (ex.image >= 240).mean() > 0.2 and ex.image.min() < 60 and ex.image.mean() > 128


def test_digit_captions(digit_splits):
  for ex in digit_splits["train"] + digit_splits["valid"]:
    d = ex.label["digit"]
    assert ex.text == digit_caption(d) == f"a handwritten {d}."
    assert digit_caption_correct(ex.text, ex.label)
    assert not digit_caption_correct(digit_caption((d + 1) % 10), ex.label)
  seven = {"digit": 7}
  for right in ("a handwritten 7.", "7", "Seven.", "a handwritten seven, clearly a 7."):
    assert digit_caption_correct(right, seven), right
  for wrong in ("a handwritten 7 or 1.", "a 7, not a 1.", "seven or eight", "a handwritten 17.",
                "a handwritten 77.", "a handwritten digit.", "", "a handwritten 1."):
    assert not digit_caption_correct(wrong, seven), wrong
  with pytest.raises(ValueError, match="0..9"):
    digit_caption(10)


@settings(max_examples=30, deadline=None)
@given(d=st.integers(0, 9), other=st.integers(0, 9), as_word=st.booleans())
def test_a_caption_naming_two_digits_is_wrong(d, other, as_word):
  words = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
  second = words[other] if as_word else str(other)
  assert digit_caption_correct(f"a handwritten {d} or a {second}.", {"digit": d}) == (d == other)


# --- scenes ---


def _check_pixels(ex, min_object: int = MIN_OBJECT) -> None:
  """What the label says, read back from the pixels alone."""
  image, label = ex.image, ex.label
  height, width, _ = image.shape
  colours, counts = np.unique(image.reshape(-1, 3), axis=0, return_counts=True)
  background = colours[np.argmax(counts)]
  assert background.min() >= 200, "the background is light"
  ink = (image != background).any(axis=2)
  # Every other pixel has the stated colour, and that colour looks like its name.
  painted = np.unique(image[ink], axis=0)
  assert len(painted) == 1 and tuple(painted[0]) == COLOURS[label["colour"]]
  r, g, b = (int(c) for c in painted[0])
  assert {"red": r > 150 and max(g, b) < 100, "green": g > max(r, b) + 50, "blue": b > max(r, g) + 50,
          "yellow": min(r, g) > 150 and b < 100}[label["colour"]]
  # All of it in the stated half: wholly on its side of the midline.
  ys, xs = np.nonzero(ink)
  assert {"left": xs.max() + 1 <= width / 2, "right": xs.min() >= width / 2,
          "top": ys.max() + 1 <= height / 2, "bottom": ys.min() >= height / 2}[label["position"]]
  # As many separate blobs as the count (touching diagonally would join two), each big enough to see in
  # 4x4 patches and filling its box as its shape does.
  blobs, n = ndimage.label(ink, structure=np.ones((3, 3)))
  assert n == label["count"]
  for box in ndimage.find_objects(blobs):
    h, w = box[0].stop - box[0].start, box[1].stop - box[1].start
    assert h >= min_object and w >= min_object
    fill = ink[box].mean()
    low, high = {"square": (0.99, 1.0), "circle": (0.62, 0.9), "triangle": (0.45, 0.62)}[label["shape"]]
    assert low <= fill <= high, (label["shape"], fill)


@pytest.fixture(scope="module")
def scenes():
  return scene_examples("train", 300)


def test_scene_pixels_match_their_labels(scenes):
  for ex in scenes:
    assert ex.kind == "scenes"
    _check_pixels(ex)
  seen = {key: {ex.label[key] for ex in scenes} for key in ("shape", "colour", "count", "position")}
  assert seen == {"shape": set(SHAPES), "colour": set(COLOURS), "count": set(COUNTS),
                  "position": set(POSITIONS)}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), min_object=st.integers(MIN_OBJECT, 12), more=st.integers(0, 16),
       extra=st.integers(0, 40))
def test_any_seed_and_size_range_draws_right(seed, min_object, more, extra):
  min_side = smallest_side(min_object) + more
  ex = draw_scene(np.random.default_rng(seed), min_side=min_side, max_side=min_side + extra,
                  min_object=min_object)
  height, width, _ = ex.image.shape
  assert min_side <= height <= min_side + extra and min_side <= width <= min_side + extra
  _check_pixels(ex, min_object)


def test_scene_sizes_and_aspect_ratios_vary(scenes):
  shapes = np.array([ex.image.shape[:2] for ex in scenes])
  assert shapes.min() >= 24 and shapes.max() <= 48
  assert (shapes[:, 0] >= 1.5 * shapes[:, 1]).sum() >= 10  # tall
  assert (shapes[:, 1] >= 1.5 * shapes[:, 0]).sum() >= 10  # wide
  assert len({tuple(s) for s in shapes}) > 100


def test_scene_captions_are_checked(scenes):
  for ex in scenes:
    assert ex.text == scene_caption(ex.label)
    assert scene_caption_correct(ex.text, ex.label)
    for key, values in (("shape", SHAPES), ("colour", tuple(COLOURS)), ("count", COUNTS),
                        ("position", POSITIONS)):
      for value in values:
        if value != ex.label[key]:
          assert not scene_caption_correct(scene_caption({**ex.label, key: value}), ex.label), (key, value)
  label = {"shape": "circle", "colour": "red", "count": 2, "position": "left"}
  assert scene_caption(label) == "two red circles on the left."
  one = {**label, "count": 1, "shape": "square", "position": "top"}
  assert scene_caption(one) == "one red square at the top."
  for right in ("two red circles on the left.", "2 red circle, left", "Two RED Circles on the LEFT!"):
    assert scene_caption_correct(right, label), right
  for wrong in ("two red and blue circles on the left.", "two red circles.", "two circles on the left.",
                "red circles on the left.", "two red circles on the left and right.", "four red circles left",
                "two red circles and squares on the left.", "2 or 3 red circles on the left.", ""):
    assert not scene_caption_correct(wrong, label), wrong


def test_scenes_are_deterministic_and_splits_differ(scenes):
  assert scene_examples("train", 300) == scenes
  assert scene_examples("train", 20, seed=1) == scene_examples("train", 20, seed=1)
  assert scene_examples("train", 20, seed=1) != scene_examples("train", 20, seed=2)
  assert draw_scene(np.random.default_rng(5)) == draw_scene(np.random.default_rng(5))
  valid = scene_examples("valid", 300)
  train_keys = {(ex.image.shape, ex.image.tobytes()) for ex in scenes}
  assert not train_keys & {(ex.image.shape, ex.image.tobytes()) for ex in valid}


def test_scene_arguments_are_checked():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="min_side"):
    draw_scene(rng, min_side=16, max_side=48)
  with pytest.raises(ValueError, match="min_side"):
    draw_scene(rng, min_side=40, max_side=30)
  with pytest.raises(ValueError, match="min_side"):
    draw_scene(rng, min_side=28, max_side=48, min_object=8)  # three 8-pixel objects need 30
  with pytest.raises(ValueError, match="min_object"):
    draw_scene(rng, min_side=30, max_side=48, min_object=4)
  with pytest.raises(ValueError, match="split"):
    scene_examples("test", 3)
