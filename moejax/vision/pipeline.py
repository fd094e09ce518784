"""Rows of images and text for training: image-text examples and text documents packed together.

Per process, for a split:
  sources (each a grain MapDataset of examples, sharded every `shard_count`-th record):
    digits   scikit-learn's scans ("train" / "valid" split), captioned    } source "embedded"
    scenes   drawn on demand from their index (moejax.vision.scenes)      }
    pairs    image-text pairs of JSONL files, decoded on demand (source = the JSONL path)
    text     windows of seq_len + 1 tokens of the prepared corpus's documents
  -> mixed by the data.images weights -> shuffled (train; every epoch anew) -> encoded
  -> bad images, and examples longer than a row, dropped (counted, warned: moejax.vision.images.SkipLog)
  -> packed greedily into rows of seq_len tokens and patches_per_row patches -> batches.

An image-text example becomes BOS, one IMAGE placeholder per merged image token, the caption, EOS; its
inputs/targets are that sequence shifted by one, as for text. The loss mask is 0 wherever the target is
a placeholder (nothing to predict there) and on padding, so the caption's first token is learnt from the
image's last token. A row's images are listed in the order of their placeholders, so the model pairs
the k-th placeholder of a row with the k-th merged image token (moejax.vision.encoder.place_images).

Each batch is a dict of numpy arrays: the text keys of moejax.data.pipeline (tokens, targets,
segment_ids, positions, loss_mask [b, T]) and the image keys of moejax.vision.batch. The iterator's
state (`get_state`/`set_state`) is JSON, as grain's CheckpointHandler stores it: the packer's state is
its parent's from before the example it holds back.
"""

import dataclasses
import hashlib

import grain
import numpy as np

from moejax.data.prepare import SPLITS, load_manifest, load_prepared_tokenizer, shard_paths
from moejax.data.tokenizer import BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, has_image_token
from moejax.vision.batch import pack_images
from moejax.vision.config import image_pixel_cap
from moejax.vision.digits import digit_examples
from moejax.vision.examples import ImageText
from moejax.vision.images import BadImage, SkipLog, read_image
from moejax.vision.pairs import list_pairs
from moejax.vision.patches import patchify
from moejax.vision.scenes import scene_at

_SPLIT_NAMES = {"train": "train", "validation": "valid"}
_PREFETCH = 16


@dataclasses.dataclass(frozen=True)
class RowShape:
  seq_len: int
  patches: int  # patches per row
  patch_size: int
  merge: int
  max_pixels: int  # an image's cap (moejax.vision.config.image_pixel_cap)

  @property
  def patch_values(self) -> int:
    return self.patch_size * self.patch_size * 3


def row_shape(config, seq_len: int) -> RowShape:
  v = config.model.vision
  return RowShape(seq_len, int(config.data.images.patches_per_row), int(v.patch_size), int(v.merge),
                  image_pixel_cap(config))


def encode_example(example, tokenizer, shape: RowShape) -> dict | None:
  """{"ids": BOS, placeholders, caption ids, EOS, "patches", "coords"} of an ImageText, or None where
  they are more than a row's seq_len + 1 tokens (the caller counts it as skipped: cutting the caption
  would teach a caption that stops short)."""
  patches, coords = patchify(example.image, patch=shape.patch_size, merge=shape.merge,
                             max_pixels=shape.max_pixels)
  placeholders = len(patches) // (shape.merge * shape.merge)
  caption = tokenizer.encode(example.text).ids
  ids = np.array([BOS_ID, *([IMAGE_ID] * placeholders), *caption, EOS_ID], np.int32)
  if len(ids) > shape.seq_len + 1:
    return None
  return {"ids": ids, "patches": patches, "coords": coords}


def _text_windows(manifest_path: str, split: str, seq_len: int):
  """A MapDataset of {"ids"} windows of at most seq_len + 1 tokens covering every document of the split
  (consecutive windows share one token, so every token but a document's first is a target once)."""
  source = grain.sources.ArrayRecordDataSource(shard_paths(manifest_path, split))
  dtype = np.dtype(load_manifest(manifest_path)["token_dtype"]).newbyteorder("<")
  windows = []
  for d in range(len(source)):
    n = len(source[d]) // dtype.itemsize
    windows += [(d, start) for start in range(0, max(n - 1, 1), seq_len)]
  windows = np.array(windows, np.int64)

  def read(i):
    d, start = windows[i]
    return {"ids": np.frombuffer(source[int(d)], dtype)[start:start + seq_len + 1].astype(np.int32)}

  return grain.MapDataset.range(len(windows)).map(read)


class _Decoded:
  """Decodes a pair's image when the pipeline reaches it; a bad one becomes None (then dropped)."""

  def __init__(self, records, max_decode_pixels: int, skips: SkipLog):
    self.records, self.max_decode_pixels, self.skips = records, max_decode_pixels, skips

  def __call__(self, i):
    where, path, text = self.records[i]
    try:
      image = read_image(path, max_decode_pixels=self.max_decode_pixels)
    except BadImage as e:
      self.skips.skip(e.reason, f"{where} ({e.detail})")
      return None
    return ImageText(image, text, "pairs", {})


def _sources(config, split: str, seq_len: int, manifest_path: str, skips: SkipLog) -> list[tuple]:
  """[(weight, MapDataset of ImageText or {"ids"} text windows)] of the configured mixture."""
  images = config.data.images
  name = _SPLIT_NAMES[split]
  out = []
  if images.source == "embedded":
    if images.digits_weight > 0:
      digits = digit_examples(name, size=images.digit_size)
      out.append((images.digits_weight, grain.MapDataset.source(digits)))
    if images.scenes_weight > 0:
      n = images.train_scenes if split == "train" else images.valid_scenes
      draw = lambda i: scene_at(name, i, min_side=images.scene_min_side, max_side=images.scene_max_side,
                                min_object=images.scene_min_object)
      out.append((images.scenes_weight, grain.MapDataset.range(n).map(draw)))
  elif images.pairs_weight > 0:
    records = [r for r in list_pairs(images.source, image_field=images.image_field,
                                     text_field=images.text_field) if _pair_split(r[1]) == split]
    if not records:
      raise ValueError(f"data.images.source={images.source!r} holds no {split} pairs")
    decoded = _Decoded(records, images.max_decode_pixels, skips)
    out.append((images.pairs_weight, grain.MapDataset.range(len(records)).map(decoded)))
  if images.text_weight > 0:
    out.append((images.text_weight, _text_windows(manifest_path, split, seq_len)))
  return out


def _pair_split(path: str) -> str:
  """Pairs are split by their image path's hash: 1 in 20 held out."""
  return "validation" if int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % 20 == 0 else "train"


def make_vision_dataset(config, manifest_path: str, split: str, *, seq_len: int, batch_size: int,
                        seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                        num_epochs: int | None = None, skips: SkipLog | None = None) -> grain.IterDataset:
  """The pipeline of the module docstring; `batch_size` rows per process."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
  tokenizer = load_prepared_tokenizer(manifest_path)
  if not has_image_token(tokenizer):
    raise ValueError(f"the tokenizer of {manifest_path} reserves no image placeholder: prepare the data "
                     "with data.image_token=True")
  skips = SkipLog() if skips is None else skips
  shape = row_shape(config, seq_len)
  sources = _sources(config, split, seq_len, manifest_path, skips)
  datasets = [ds[shard_index::shard_count] for _, ds in sources]
  if any(len(ds) == 0 for ds in datasets):
    raise ValueError(f"a source of split {split!r} has fewer records than the {shard_count} processes")
  ds = grain.MapDataset.mix(datasets, [w for w, _ in sources]) if len(datasets) > 1 else datasets[0]
  if split == "train":
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)

  def encode(item):
    if item is None or isinstance(item, dict):
      return item
    encoded = encode_example(item, tokenizer, shape)
    if encoded is None:
      skips.skip("too long", f"a {item.kind} example of {item.image.shape[1]}x{item.image.shape[0]} pixels "
                             f"and {len(item.text)} characters of text, beyond a row of {seq_len} tokens")
    return encoded

  ds = ds.map(encode)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=_PREFETCH))
  it = it.filter(lambda x: x is not None)
  return PackedRows(it, shape).batch(batch_size, drop_remainder=True)


class PackedRows(grain.IterDataset):
  """Packs encoded examples ({"ids"[, "patches", "coords"]}) greedily, in order, into rows of
  `shape.seq_len` tokens and `shape.patches` patches: an example that does not fit closes the row and
  opens the next. The last row of a finite stream is padded."""

  def __init__(self, parent: grain.IterDataset, shape: RowShape):
    super().__init__(parent)
    self._shape = shape

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedRowsIterator(self._parent.__iter__(), self._shape)


class _PackedRowsIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, shape: RowShape):
    super().__init__(parent)
    self._shape = shape
    self._held = None  # the example that closed the last row, with the parent state from before it
    self._held_state = None

  def __next__(self):
    row = _Row(self._shape)
    while True:
      if self._held is None:
        state = self._parent.get_state()
        try:
          item = next(self._parent)
        except StopIteration:
          if row.empty:
            raise
          return row.finish()
        self._held, self._held_state = item, state
      if not row.fits(self._held):
        return row.finish()
      row.add(self._held)
      self._held = self._held_state = None

  def get_state(self):
    return {"parent": self._held_state if self._held is not None else self._parent.get_state()}

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._held = self._held_state = None


class _Row:
  def __init__(self, shape: RowShape):
    self.shape = shape
    self.items = []
    self.tokens = self.patches = 0

  @property
  def empty(self) -> bool:
    return not self.items

  def fits(self, item) -> bool:
    n = len(item["ids"]) - 1
    p = len(item["patches"]) if "patches" in item else 0
    return self.tokens + n <= self.shape.seq_len and self.patches + p <= self.shape.patches

  def add(self, item):
    self.items.append(item)
    self.tokens += len(item["ids"]) - 1
    self.patches += len(item["patches"]) if "patches" in item else 0

  def finish(self) -> dict:
    return pack_row(self.items, self.shape)


def pack_row(items: list[dict], shape: RowShape) -> dict:
  """One batch row of encoded examples ({"ids"[, "patches", "coords"]}) that fit it, in order: example
  ids e cover len(e) - 1 positions (inputs e[:-1], targets e[1:]) as segment 1, 2, ...; padding after
  them; the images packed by `pack_images`; the loss mask 0 on padding and where the target is a
  placeholder."""
  T = shape.seq_len
  tokens, targets = np.full(T, PAD_ID, np.int32), np.full(T, PAD_ID, np.int32)
  segments, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
  t = 0
  for segment, item in enumerate(items, start=1):
    ids = item["ids"]
    n = len(ids) - 1
    tokens[t:t + n], targets[t:t + n] = ids[:-1], ids[1:]
    segments[t:t + n], positions[t:t + n] = segment, np.arange(n)
    t += n
  patches, image_ids, coords = pack_images([(item["patches"], item["coords"]) for item in items
                                            if "patches" in item], shape.patches, shape.patch_values)
  loss_mask = ((segments != 0) & (targets != IMAGE_ID)).astype(np.float32)
  return {"tokens": tokens, "targets": targets, "segment_ids": segments, "positions": positions,
          "loss_mask": loss_mask, "image_patches": patches, "image_ids": image_ids, "image_coords": coords}
