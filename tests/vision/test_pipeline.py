"""Rows of images and text (moejax.vision.pipeline): placeholders and the loss mask, packing budgets,
exact resume, image-text pairs from JSONL with bad images skipped and counted."""

import json

import numpy as np
import pytest
from PIL import Image

from moejax.data.prepare import prepare
from moejax.data.tokenizer import IMAGE_ID
from moejax.vision.images import SkipLog
from moejax.vision.pairs import list_pairs
from moejax.vision.pipeline import _pair_split, make_vision_dataset
from tests.vision.test_encoder import MERGE, PATCH, vision_config

SEQ = 64


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """A small stdlib corpus with the image placeholder reserved, and a config that reads it."""
  cfg = vision_config()
  cfg.data.update(cache_dir=str(tmp_path_factory.mktemp("cache")), max_bytes=300_000, read_threads=0)
  cfg.data.images.update(scene_min_side=24, scene_max_side=32, train_scenes=200, valid_scenes=40,
                         text_weight=0.3)
  return cfg, prepare(cfg.data)


def _batches(cfg, manifest, n, split="train", **kw):
  it = iter(make_vision_dataset(cfg, manifest, split, seq_len=SEQ, batch_size=4, seed=0, **kw))
  return it, [next(it) for _ in range(n)]


def test_rows_hold_each_images_tokens_and_mask_the_placeholders(prepared):
  cfg, manifest = prepared
  _, batches = _batches(cfg, manifest, 4)
  group = MERGE * MERGE
  text_only_rows = 0
  for b in batches:
    assert b["tokens"].shape == (4, SEQ) and b["image_patches"].shape == (4, 64, PATCH * PATCH * 3)
    for r in range(4):
      placeholders = int(np.sum(b["tokens"][r] == IMAGE_ID))
      assert placeholders * group == int(np.sum(b["image_ids"][r] > 0))  # one per merged image token
      # Targets that are placeholders are never learnt; every other real target is.
      real = b["segment_ids"][r] > 0
      np.testing.assert_array_equal(b["loss_mask"][r] > 0, real & (b["targets"][r] != IMAGE_ID))
      # Images are numbered in order and each is a whole number of merge blocks.
      ids = b["image_ids"][r][b["image_ids"][r] > 0]
      assert list(np.unique(ids)) == list(range(1, ids.max() + 1)) if len(ids) else True
      assert all(np.sum(ids == k) % group == 0 for k in np.unique(ids))
      text_only_rows += placeholders == 0
      # Each segment is one example: BOS first, and an image example's placeholders right after it.
      for s in np.unique(b["segment_ids"][r][real]):
        seg = b["tokens"][r][b["segment_ids"][r] == s]
        if IMAGE_ID in seg:
          k = int(np.sum(seg == IMAGE_ID))
          assert seg[0] == 1 and np.all(seg[1:1 + k] == IMAGE_ID)
  assert text_only_rows < 16  # the mixture is mostly images


def test_the_iterator_resumes_exactly(prepared):
  cfg, manifest = prepared
  it, _ = _batches(cfg, manifest, 3)
  state = json.loads(json.dumps(it.get_state()))  # as grain's checkpoint handler stores it
  want = [next(it) for _ in range(2)]
  again = iter(make_vision_dataset(cfg, manifest, "train", seq_len=SEQ, batch_size=4, seed=0))
  again.set_state(state)
  for w in want:
    got = next(again)
    for k in w:
      np.testing.assert_array_equal(got[k], w[k])


def test_pairs_from_jsonl_skip_bad_images_and_count_them(prepared, tmp_path, caplog):
  cfg, manifest = prepared
  rng = np.random.default_rng(0)
  lines = []
  for i in range(60):
    name = f"img{i}.png"
    Image.fromarray(rng.integers(0, 256, (8 * (1 + i % 3), 16, 3), dtype=np.uint8)).save(tmp_path / name)
    lines.append({"image": name, "text": f"picture number {i}."})
  (tmp_path / "corrupt.png").write_bytes(b"\x89PNG not really")
  (tmp_path / "empty.png").write_bytes(b"")
  lines += [{"image": "corrupt.png", "text": "bad."}, {"image": "empty.png", "text": "bad."},
            {"image": "missing.png", "text": "bad."}]
  for i in range(4):  # good images whose captions overflow a row of SEQ tokens
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / f"long{i}.png")
    lines.append({"image": f"long{i}.png", "text": "a caption far too long for its row. " * 20})
  (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
  cfg = cfg.copy_and_resolve_references()
  cfg.data.images.update(source=str(tmp_path / "pairs.jsonl"), text_weight=0.0)
  skips = SkipLog()
  it = iter(make_vision_dataset(cfg, manifest, "train", seq_len=SEQ, batch_size=1, seed=0, num_epochs=1,
                                skips=skips))
  seen_bos = [b["tokens"] == 1 for b in it]  # one BOS per example packed
  # Exactly the bad pairs that the path hash puts into the train split are skipped, each counted once
  # under its reason and warned about; the good ones all arrive.
  records = [r for r in list_pairs(str(tmp_path / "pairs.jsonl")) if _pair_split(r[1]) == "train"]
  bad = {"corrupt.png": "corrupt", "empty.png": "empty", "missing.png": "missing",
         **{f"long{i}.png": "too long" for i in range(4)}}
  want = {}
  for _, path, _ in records:
    reason = bad.get(path.rsplit("/", 1)[-1])
    if reason:
      want[reason] = want.get(reason, 0) + 1
  assert skips.counts() == want
  warned = [r for r in caplog.records if r.name == "moejax.vision" and "skipped" in r.getMessage()]
  assert len(warned) == sum(want.values())
  good = len(records) - sum(want.values())
  assert sum(int(np.sum(b_row)) for b_row in seen_bos) == good
