"""Data: the prepare step (split, tokenizer, shards, cache) and the packed grain pipeline.

Shards are read back with ArrayRecordReader, not grain, so the packing checks compare the
pipeline against an independent view of the documents.
"""

import hashlib
import json
import os
import random
import time

import grain
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader

from moejax.data import default_data_config, make_dataset, make_iterator
from moejax.data import tokenizer as tk
from moejax.data.prepare import load_manifest, load_prepared_tokenizer, main, prepare, shard_paths

VALID_FRACTION = 0.25
WORDS = ["alpha", "beta", "gamma", "δέλτα", "naïve", "日本語", "🙂", "x", "==", "\t", "  ", "\r\n",
         "def", "return", "<|eos|>", "0123"]


def _text(rng: random.Random, n_words: int) -> str:
  return " ".join(rng.choice(WORDS) for _ in range(n_words)) + rng.choice(["", "\n", " \n\n"])


def _cfg(source, cache_dir, **kw):
  c = default_data_config()
  c.update(dict(source=str(source), cache_dir=str(cache_dir), vocab_size=300,
                valid_fraction=VALID_FRACTION, max_bytes=0, read_threads=0))
  c.update(kw)
  return c


def _unit_hash(key: str) -> float:
  return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2.0**64


def _read_split(manifest_path, split) -> list[np.ndarray]:
  dtype = np.dtype(load_manifest(manifest_path)["token_dtype"])
  docs = []
  for path in shard_paths(manifest_path, split):
    reader = ArrayRecordReader(path)
    docs += [np.frombuffer(r, dtype).astype(np.int64) for r in reader.read_all()]
    reader.close()
  return docs


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(0)
  texts = {}
  for i in range(14):
    rel = f"sub/doc{i:02d}.txt" if i % 4 == 0 else f"doc{i:02d}.txt"
    texts[rel] = _text(rng, rng.choice([3, 20, 60, 400]))
  for rel, text in texts.items():
    os.makedirs(root / os.path.dirname(rel), exist_ok=True)
    (root / rel).write_text(text, encoding="utf-8", newline="")
  (root / ".hidden.txt").write_text("never read")
  cfg = _cfg(root, tmp_path_factory.mktemp("cache"))
  return cfg, prepare(cfg), texts


def test_prepare_splits_by_file_and_round_trips(text_corpus):
  cfg, manifest_path, texts = text_corpus
  manifest = load_manifest(manifest_path)
  tok = load_prepared_tokenizer(manifest_path)
  want_valid = {rel for rel in texts if _unit_hash(rel) < VALID_FRACTION}
  assert 0 < len(want_valid) < len(texts), "fixture should exercise both splits without fallback"

  got = {}
  for split in ("train", "validation"):
    docs = _read_split(manifest_path, split)
    assert manifest["splits"][split]["documents"] == len(docs)
    assert manifest["splits"][split]["tokens"] == sum(len(d) for d in docs)
    for ids in docs:
      assert ids[0] == tk.BOS_ID and ids[-1] == tk.EOS_ID
      assert not np.isin(ids[1:-1], [tk.PAD_ID, tk.BOS_ID, tk.EOS_ID]).any()
      got[tk.decode(tok, ids)] = split
  # Every file is exactly one document, whole, in the split its path hash picks; the hidden one
  # is not read.
  assert len(got) == len(texts)
  assert got == {text: "validation" if rel in want_valid else "train" for rel, text in texts.items()}
  assert manifest["files_listed"] == len(texts)
  assert manifest["tokenizer"]["vocab_size"] <= 300


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.text(max_size=200))
def test_tokenizer_round_trip(text_corpus, text):
  tok = load_prepared_tokenizer(text_corpus[1])
  (ids,) = tk.encode_documents(tok, [text])
  assert ids[0] == tk.BOS_ID and ids[-1] == tk.EOS_ID
  assert not np.isin(ids[1:-1], [tk.BOS_ID, tk.EOS_ID]).any()
  assert tk.decode(tok, ids) == text


@pytest.fixture(scope="module")
def digit_tokenizer(tmp_path_factory):
  texts = [f"Compute {a}*{b}. <tool>{a}*{b}</tool> Answer: {a * b}"
           for a in range(10, 99, 7) for b in range(3, 999, 37)]
  tok = tk.train_tokenizer(texts, 400, individual_digits=True)
  path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
  tk.save_tokenizer(tok, path)
  return tk.load_tokenizer(path)  # the setting survives the file


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.text(max_size=200), st.integers(0, 10**12))
def test_individual_digits_are_one_token_each_wherever_they_stand(digit_tokenizer, text, number):
  tok = digit_tokenizer
  (ids,) = tk.encode_documents(tok, [text])
  assert tk.decode(tok, ids) == text
  digits = [tok.token_to_id(d) for d in str(number)]
  for context in (f" {number}.", f">{number}<", f"\n{number}", f"x{number}y"):
    got = tok.encode(context).ids
    assert any(got[i:i + len(digits)] == digits for i in range(len(got))), (context, got)


def test_prepare_reuses_cache_and_notices_edits(text_corpus, tmp_path):
  cfg, manifest_path, texts = text_corpus
  before = os.stat(manifest_path)
  t0 = time.perf_counter()
  assert prepare(cfg) == manifest_path
  assert time.perf_counter() - t0 < 2.0
  after = os.stat(manifest_path)
  assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

  # An edited corpus gets a fresh folder; the old one stays valid for the old inputs.
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("first document")
  (src / "b.txt").write_text("second document")
  c = _cfg(src, tmp_path / "cache")
  m1 = prepare(c)
  (src / "b.txt").write_text("second document, edited")
  m2 = prepare(c)
  assert m1 != m2 and os.path.exists(m1)
  assert load_manifest(m1)["content_sha256"] != load_manifest(m2)["content_sha256"]

  # An explicit folder is rebuilt in place, but never one that holds foreign files.
  out = tmp_path / "out"
  m3 = prepare(c, out_dir=str(out))
  (src / "b.txt").write_text("second document, edited twice")
  assert prepare(c, out_dir=str(out)) == m3
  assert load_manifest(m3)["content_sha256"] != load_manifest(m2)["content_sha256"]
  foreign = tmp_path / "foreign"
  foreign.mkdir()
  (foreign / "keep.txt").write_text("mine")
  with pytest.raises(ValueError, match="refusing"):
    prepare(c, out_dir=str(foreign))


def test_prepare_jsonl(tmp_path):
  lines = [json.dumps({"body": "first record", "id": 1}), "",
           json.dumps({"body": "line\u2028separator inside", "id": 2}, ensure_ascii=False)]
  lines += [json.dumps({"body": f"record {i} " * (i + 1)}) for i in range(12)]
  path = tmp_path / "data.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  c = _cfg(path, tmp_path / "cache", format="jsonl", text_field="body")
  manifest_path = prepare(c)
  tok = load_prepared_tokenizer(manifest_path)
  decoded = {s: [tk.decode(tok, ids) for ids in _read_split(manifest_path, s)]
             for s in ("train", "validation")}
  bodies = [json.loads(line)["body"] for line in lines if line]
  keys = [f"data.jsonl:{n}" for n, line in enumerate(lines, 1) if line]
  want_valid = [b for b, k in zip(bodies, keys, strict=True) if _unit_hash(k) < VALID_FRACTION]
  assert 0 < len(want_valid) < len(bodies)
  assert decoded["validation"] == want_valid
  assert sorted(decoded["train"] + decoded["validation"]) == sorted(bodies)

  with open(path, "a") as f:
    f.write(json.dumps({"text": "wrong key"}) + "\n")
  with pytest.raises(ValueError, match=r"data\.jsonl:16: no text field 'body'"):
    prepare(c)


def test_prepare_errors(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(ValueError, match="matches no files"):
    prepare(_cfg(tmp_path / "empty" / "*.txt", tmp_path / "c"))
  with pytest.raises(ValueError, match="does not exist"):
    prepare(_cfg(tmp_path / "missing", tmp_path / "c"))
  (empty / "a.txt").write_text("")
  with pytest.raises(ValueError, match="no non-empty documents"):
    prepare(_cfg(empty, tmp_path / "c"))
  (empty / "b.bin").write_bytes(b"\xff\xfe\x00bad")
  with pytest.raises(ValueError, match=r"b\.bin: not UTF-8"):
    prepare(_cfg(empty, tmp_path / "c"))
  with pytest.raises(ValueError, match="vocab_size=200 is too small"):
    prepare(_cfg(empty, tmp_path / "c", vocab_size=200))
  with pytest.raises(ValueError, match="data.format"):
    prepare(_cfg("stdlib", tmp_path / "c", format="jsonl"))
  one = tmp_path / "one"
  one.mkdir()
  (one / "a.txt").write_text("only one")
  with pytest.raises(ValueError, match="two"):
    prepare(_cfg(one, tmp_path / "c"))


def test_prepare_stdlib_default(tmp_path):
  c = default_data_config()
  c.update(dict(cache_dir=str(tmp_path), max_bytes=150_000, vocab_size=512))
  t0 = time.perf_counter()
  manifest = load_manifest(prepare(c))
  assert time.perf_counter() - t0 < 60
  assert manifest["files_listed"] > 100
  for split in ("train", "validation"):
    assert manifest["splits"][split]["documents"] > 0
  total = sum(s["text_bytes"] for s in manifest["splits"].values())
  assert 150_000 <= total < 150_000 + 200_000  # the cap stops after the file that crosses it


def test_cli(text_corpus, tmp_path, capsys):
  cfg = text_corpus[0]
  main(["--source", cfg.source, "--out", str(tmp_path / "cli"), "--vocab_size", "280",
        "--valid_fraction", "0.25"])
  assert "manifest:" in capsys.readouterr().out
  assert load_manifest(tmp_path / "cli" / "manifest.json")["tokenizer"]["vocab_size"] <= 280


# --- packing -------------------------------------------------------------------------------------


def _rows(manifest_path, split="train", **kw):
  kw = dict(seq_len=16, batch_size=1, shuffle=False, num_epochs=1, read_threads=0) | kw
  rows = []
  for batch in make_dataset(manifest_path, split, **kw):
    rows += [{k: v[i] for k, v in batch.items()} for i in range(len(batch["tokens"]))]
  return rows


def _segments(rows):
  """Checks the per-row invariants and returns each row's (tokens, targets) pieces in order."""
  pieces = []
  for r in rows:
    seg, pos = r["segment_ids"], r["positions"]
    assert seg.shape == (16,) and all(r[k].dtype == np.int32 for k in
                                      ("tokens", "targets", "segment_ids", "positions"))
    assert r["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(r["loss_mask"], (seg != 0).astype(np.float32))
    n = int((seg != 0).sum())
    assert (seg[n:] == 0).all() and (r["tokens"][n:] == 0).all() and (r["targets"][n:] == 0).all()
    assert n > 0 and seg[0] == 1
    # Ids count up by one exactly where a piece starts, and positions restart there.
    starts = np.flatnonzero(np.diff(seg[:n], prepend=0))
    np.testing.assert_array_equal(np.diff(seg[:n], prepend=0)[starts], 1)
    np.testing.assert_array_equal(starts, np.flatnonzero(pos[:n] == 0))
    for a, b in zip(starts, [*starts[1:], n], strict=True):
      np.testing.assert_array_equal(pos[a:b], np.arange(b - a))
      pieces.append((r["tokens"][a:b], r["targets"][a:b]))
  return pieces


def test_packing_reconstructs_documents(text_corpus):
  manifest_path = text_corpus[1]
  docs = _read_split(manifest_path, "train")
  pieces = _segments(_rows(manifest_path))
  # Unshuffled, the pieces are the documents in order, cut only at piece ends: every document
  # boundary is a piece boundary, so no piece (and no target) spans two documents.
  piece_ends = np.cumsum([len(t) for t, _ in pieces])
  doc_ends = np.cumsum([len(d) - 1 for d in docs])
  assert set(doc_ends) <= set(piece_ends) and piece_ends[-1] == doc_ends[-1]
  np.testing.assert_array_equal(np.concatenate([t for t, _ in pieces]),
                                np.concatenate([d[:-1] for d in docs]))
  np.testing.assert_array_equal(np.concatenate([y for _, y in pieces]),
                                np.concatenate([d[1:] for d in docs]))
  assert any(len(d) > 16 for d in docs), "fixture should make documents span rows"


def test_packing_shuffled_pieces_are_document_slices(text_corpus):
  manifest_path = text_corpus[1]
  docs = _read_split(manifest_path, "train")
  rows = _rows(manifest_path, shuffle=True, shuffle_buffer=8, seed=3, batch_size=2)
  assert len(rows) >= 0.9 * sum(len(d) - 1 for d in docs) / 16
  for x, y in _segments(rows):
    np.testing.assert_array_equal(y[:-1], x[1:])
    window = np.append(x, y[-1])  # inputs and targets together: one contiguous slice of a doc
    assert any(len(d) >= len(window) and
               (np.lib.stride_tricks.sliding_window_view(d, len(window)) == window).all(1).any()
               for d in docs), "a packed piece is not a contiguous slice of one document"


def test_sharding_partitions_documents(text_corpus):
  manifest_path = text_corpus[1]
  docs = sorted(tuple(d[:-1]) for d in _read_split(manifest_path, "train"))
  seen = []
  for index in range(2):
    stream = np.concatenate([t for t, _ in _segments(_rows(manifest_path, shard_index=index,
                                                           shard_count=2))])
    # The token stream is the documents' BOS..(last id) runs back to back: cut at each BOS.
    starts = [*np.flatnonzero(stream == tk.BOS_ID), len(stream)]
    seen.append({tuple(stream[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)})
  assert not seen[0] & seen[1]
  assert sorted(seen[0] | seen[1]) == docs


def _assert_batches_equal(xs, ys):
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys, strict=True):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("skip", [1, 4, 9])
def test_iterator_state_restores_exact_batches(text_corpus, skip):
  cfg = text_corpus[0].copy_and_resolve_references()
  cfg.shuffle_buffer = 5
  it = make_iterator(cfg, "train", seq_len=16, global_batch_size=4, shard_index=0, shard_count=2)
  for _ in range(skip):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # as grain's checkpoint handler stores it
  want = [next(it) for _ in range(6)]
  fresh = make_iterator(cfg, "train", seq_len=16, global_batch_size=4, shard_index=0, shard_count=2)
  fresh.set_state(state)
  _assert_batches_equal([next(fresh) for _ in range(6)], want)
  assert want[0]["tokens"].shape == (2, 16)


def test_orbax_checkpoint_round_trip(text_corpus, tmp_path):
  import orbax.checkpoint as ocp

  cfg = text_corpus[0]
  it = make_iterator(cfg, "train", seq_len=16, global_batch_size=2, seed=7, shard_index=0,
                     shard_count=1)
  for _ in range(5):
    next(it)
  with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    want = [next(it) for _ in range(4)]
    fresh = make_iterator(cfg, "train", seq_len=16, global_batch_size=2, seed=7, shard_index=0,
                          shard_count=1)
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
  _assert_batches_equal([next(fresh) for _ in range(4)], want)


def test_make_iterator_contract(text_corpus):
  cfg = text_corpus[0]
  batch = next(make_iterator(cfg, "validation", seq_len=8, global_batch_size=6, shard_index=1,
                             shard_count=3))
  assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
      "tokens": ((2, 8), "int32"), "targets": ((2, 8), "int32"), "segment_ids": ((2, 8), "int32"),
      "positions": ((2, 8), "int32"), "loss_mask": ((2, 8), "float32")}
  with pytest.raises(ValueError, match="multiple of the process count"):
    make_iterator(cfg, "train", seq_len=8, global_batch_size=5, shard_index=0, shard_count=2)
  with pytest.raises(ValueError, match="seq_len=1 must be >= 2"):
    make_iterator(cfg, "train", seq_len=1, global_batch_size=2, shard_index=0, shard_count=1)
  with pytest.raises(ValueError, match="unknown split"):
    make_iterator(cfg, "test", seq_len=8, global_batch_size=2, shard_index=0, shard_count=1)
