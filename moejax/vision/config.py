"""The `model.vision` sub-config (the tower) and `data.images` (what images the run reads)."""

import ml_collections

from moejax.errors import ConfigError
from moejax.vision.scenes import MIN_OBJECT, smallest_side

ATTENTIONS = ("auto", "xla", "pallas", "interpret")
IMAGE_SOURCES = ("", "embedded")  # or a JSONL path, glob or fsspec URL


def default_vision_config() -> ml_collections.ConfigDict:
  v = ml_collections.ConfigDict()
  v.enabled = False  # a tower, and images in the text stream (data.images, data.image_token)
  v.patch_size = 14
  v.merge = 2  # merge x merge neighbouring patches become one decoder token
  # Larger images are scaled down, aspect ratio kept, to at most this many pixels; smaller ones keep
  # their size (each side rounded to a multiple of patch_size * merge).
  v.max_pixels = 1024 * 1024
  v.width = 64
  v.depth = 2
  v.num_heads = 4
  v.mlp_dim = 256
  v.position_grid = 16  # the learned position table is position_grid^2 cells, resampled to each image
  v.rope_theta = 10000.0
  v.projector_dim = 0  # the projector MLP's hidden width (0: model.d_model)
  # The tower's attention: "auto" (Pallas kernels on a GPU in 16-bit, XLA elsewhere), "xla", "pallas",
  # "interpret".
  v.attention = "auto"
  return v


def default_image_data_config() -> ml_collections.ConfigDict:
  i = ml_collections.ConfigDict()
  # "" (text only), "embedded" (scikit-learn's digits and drawn scenes, generated here), or a JSONL
  # path, glob or fsspec URL of {image_field: image path, text_field: caption} lines.
  i.source = ""
  i.image_field = "image"
  i.text_field = "text"
  # The mixture of what a row packs: image-text examples of each kind, and text documents of the corpus.
  i.digits_weight = 1.0
  i.scenes_weight = 1.0
  i.pairs_weight = 1.0
  i.text_weight = 0.1
  i.patches_per_row = 256  # a row's image budget in patches (batch["image_patches"] is [B, this, p*p*3])
  i.digit_size = 16  # pixels a side of an upscaled 8x8 digit
  i.scene_min_side = 24  # drawn scenes: each side drawn from [min, max] pixels
  i.scene_max_side = 48
  i.scene_min_object = 6  # pixels across, at the least, of a drawn object (sides then >= 3 x (this + 2))
  i.train_scenes = 100_000  # distinct training scenes (then they repeat)
  i.valid_scenes = 500  # held-out scenes (validation and the captions evaluation)
  i.max_decode_pixels = 64 << 20  # larger images are skipped undecoded (decompression bombs)
  return i


def validate_vision(config) -> None:
  """Raises ConfigError naming the offending `model.vision.*` or `data.images.*` field."""

  def need(cond, msg):
    if not cond:
      raise ConfigError(msg)

  v, images = config.model.vision, config.data.images
  need(isinstance(v.enabled, bool), f"model.vision.enabled must be True or False, got {v.enabled!r}")
  if not v.enabled:
    need(images.source == "", "data.images.source is set but model.vision.enabled is False: the model "
                              "would have no tower to read the images with")
    return
  for name in ("patch_size", "merge", "width", "depth", "num_heads", "mlp_dim", "position_grid"):
    need(isinstance(v[name], int) and v[name] >= 1,
         f"model.vision.{name} must be a positive int, got {v[name]!r}")
  need(v.width % v.num_heads == 0 and (v.width // v.num_heads) % 4 == 0,
       f"model.vision.width={v.width} must split into num_heads={v.num_heads} heads of a multiple of 4 "
       "features (2D RoPE rotates quarters of a head)")
  need(isinstance(v.projector_dim, int) and v.projector_dim >= 0, "model.vision.projector_dim must be >= 0")
  unit = v.patch_size * v.merge
  need(v.max_pixels >= unit * unit, f"model.vision.max_pixels={v.max_pixels} is below one merged patch "
                                    f"({unit}x{unit} pixels)")
  need(v.rope_theta > 0, "model.vision.rope_theta must be positive")
  need(v.attention in ATTENTIONS, f"model.vision.attention={v.attention!r} not in {ATTENTIONS}")
  need(config.data.image_token, "model.vision.enabled needs data.image_token=True: the tokenizer must "
                                "reserve the image placeholder")
  need(isinstance(images.source, str) and images.source.strip() != "",
       "model.vision.enabled needs data.images.source: 'embedded' or a JSONL path of image-text pairs")
  group = v.merge * v.merge
  need(isinstance(images.patches_per_row, int) and images.patches_per_row >= group
       and images.patches_per_row % group == 0,
       f"data.images.patches_per_row={images.patches_per_row} must be a positive multiple of merge^2={group}")
  image_tokens = image_pixel_cap(config) // (v.patch_size * v.patch_size) // group
  for seq_len, _, _ in config.train.stages:
    need(seq_len >= image_tokens + 2,
         f"train.stages: rows of {seq_len} tokens cannot hold the largest image ({image_tokens} tokens, "
         "with BOS and EOS; model.vision.max_pixels and data.images.patches_per_row cap it): raise the "
         "sequence length or lower those caps")
  for name in ("digits_weight", "scenes_weight", "pairs_weight", "text_weight"):
    need(images[name] >= 0, f"data.images.{name} must be >= 0")
  kinds = ("digits_weight", "scenes_weight") if images.source == "embedded" else ("pairs_weight",)
  need(sum(images[k] for k in kinds) > 0, f"data.images: one of {kinds} must be positive")
  need(isinstance(images.scene_min_object, int) and images.scene_min_object >= MIN_OBJECT,
       f"data.images.scene_min_object={images.scene_min_object} must be an int >= {MIN_OBJECT}")
  need(smallest_side(images.scene_min_object) <= images.scene_min_side <= images.scene_max_side,
       f"data.images.scene_min_side={images.scene_min_side} must be >= "
       f"{smallest_side(images.scene_min_object)} (three objects of scene_min_object pixels in a half) "
       f"and <= scene_max_side={images.scene_max_side}")
  for name in ("digit_size", "train_scenes", "valid_scenes", "max_decode_pixels"):
    need(isinstance(images[name], int) and images[name] >= 1, f"data.images.{name} must be a positive int")


def image_pixel_cap(config) -> int:
  """The most pixels an image keeps (moejax.vision.patches.fitted_size): model.vision.max_pixels, and no
  more than a training row's patch budget holds, so training and generation see an image the same size."""
  v = config.model.vision
  return min(int(v.max_pixels), int(config.data.images.patches_per_row) * v.patch_size * v.patch_size)
