"""One training example for vision input: an RGB image and the text that goes with it.

Every source of images (scikit-learn's digits, the drawn scenes, image-text pairs read from JSONL) yields
`ImageText`, so the pipeline that patches images and packs them with text sees one type. The label keeps
what the caption must state, so that a generated caption can be checked against it (`digit_caption_correct`,
`scene_caption_correct`) rather than compared word for word with the reference.
"""

import dataclasses

import numpy as np

KINDS = ("digits", "scenes", "pairs")


@dataclasses.dataclass(frozen=True)
class ImageText:
  """An image and its caption. The image is stored as a read-only view: an example is a value, and a
  pipeline stage that wants to change pixels must copy them first. Two examples are equal when their
  pixels, text, kind and label are."""

  image: np.ndarray  # uint8 [H, W, 3] RGB
  text: str  # the caption
  kind: str  # "digits" | "scenes" | "pairs"
  label: dict  # what a caption must state ({"digit": 7} or the scene's attributes; {} for pairs)

  def __post_init__(self):
    image = self.image
    if not isinstance(image, np.ndarray):
      raise TypeError(f"ImageText.image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
      raise ValueError(f"ImageText.image must be uint8, got {image.dtype}")
    if image.ndim != 3 or image.shape[2] != 3:
      raise ValueError(f"ImageText.image must be [H, W, 3] RGB, got shape {image.shape}")
    if image.shape[0] < 1 or image.shape[1] < 1:
      raise ValueError(f"ImageText.image must be at least 1x1 pixels, got shape {image.shape}")
    if not isinstance(self.text, str):
      raise TypeError(f"ImageText.text must be a str, got {type(self.text).__name__}")
    if self.kind not in KINDS:
      raise ValueError(f"ImageText.kind must be one of {KINDS}, got {self.kind!r}")
    if not isinstance(self.label, dict):
      raise TypeError(f"ImageText.label must be a dict, got {type(self.label).__name__}")
    view = image.view()
    view.flags.writeable = False
    object.__setattr__(self, "image", view)

  def __eq__(self, other: object) -> bool:
    # The generated __eq__ would compare the arrays with ==, whose truth value numpy refuses to give.
    if not isinstance(other, ImageText):
      return NotImplemented
    return (self.text == other.text and self.kind == other.kind and self.label == other.label
            and np.array_equal(self.image, other.image))
