"""The prepare step: corpus -> train/validation split -> byte-level BPE -> ArrayRecord shards.

    python -m moejax.data.prepare --source stdlib --vocab_size 1024 [--out DIR]
    python -m moejax.data.prepare --source 'gs://bucket/corpus/*.jsonl' --format jsonl

writes into one folder:
  tokenizer.json                      the trained tokenizer (`tokenizer.load_tokenizer`)
  {train,validation}-NNNNN.array_record  one record per document: BOS ids EOS, as little-endian
                                      `token_dtype` bytes
  manifest.json                       counts, shard names, settings, content hash, fingerprint

Caching: the folder's manifest stores a fingerprint of the settings and of the source listing
(paths, sizes, modification stamps: no file is read to compute it). `prepare` returns at once
when the fingerprint matches, so the train loop calls it on every start. A build goes to a
temporary sibling folder that is renamed into place, so an interrupted build leaves no
half-written cache, and processes racing to build the same folder all end up with one copy.

Split: a document is in validation when the hash of its key (the relative file path; for JSONL
`path:line`) falls below `valid_fraction`. A text file is never cut across splits.
"""

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid

import numpy as np
import tokenizers
from array_record.python.array_record_module import ArrayRecordWriter

from moejax.data import tokenizer as tk
from moejax.data.config import default_data_config, validate_data_config
from moejax.data.corpus import Corpus, find_corpus, iter_documents

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "validation")
SHARD_BYTES = 256 << 20
_ENCODE_BATCH = 256  # documents per encode_batch call: enough to keep the Rust threads busy

_SETTINGS = ("source", "format", "text_field", "vocab_size", "max_files", "max_bytes",
             "tokenizer_train_bytes", "valid_fraction", "image_token")


def prepare(data_cfg, out_dir: str | None = None) -> str:
  """Builds (or finds cached) shards for `data_cfg`; returns the manifest path.

  `out_dir` defaults to `data_cfg.cache_dir/<source name>-<fingerprint>`. An existing `out_dir`
  that is not empty and holds no manifest is never overwritten.
  """
  validate_data_config(data_cfg)
  settings = {k: data_cfg[k] for k in _SETTINGS}
  corpus = find_corpus(data_cfg.source)
  fingerprint = _fingerprint(corpus, settings)
  if out_dir is None:
    out_dir = os.path.join(data_cfg.cache_dir, f"{_slug(data_cfg.source)}-{fingerprint[:16]}")
  out_dir = os.path.abspath(out_dir)
  manifest_path = os.path.join(out_dir, MANIFEST)
  if _is_current(manifest_path, fingerprint):
    return manifest_path
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.exists(manifest_path):
    raise ValueError(f"refusing to write into {out_dir!r}: it is not empty and holds no {MANIFEST}")

  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
  try:
    _build(corpus, data_cfg, settings, fingerprint, tmp)
    _publish(tmp, out_dir, manifest_path, fingerprint)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return manifest_path


def load_manifest(path: str) -> dict:
  with open(path) as f:
    manifest = json.load(f)
  if manifest.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"{path}: manifest format {manifest.get('format_version')} is not "
                     f"{FORMAT_VERSION}; re-run the prepare step")
  return manifest


def shard_paths(manifest_path: str, split: str) -> list[str]:
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
  root = os.path.dirname(os.path.abspath(manifest_path))
  return [os.path.join(root, s) for s in load_manifest(manifest_path)["splits"][split]["shards"]]


def load_prepared_tokenizer(manifest_path: str) -> tokenizers.Tokenizer:
  root = os.path.dirname(os.path.abspath(manifest_path))
  return tk.load_tokenizer(os.path.join(root, load_manifest(manifest_path)["tokenizer"]["file"]))


def _fingerprint(corpus: Corpus, settings: dict) -> str:
  blob = json.dumps({"format_version": FORMAT_VERSION, "tokenizers": tokenizers.__version__,
                     "settings": settings, "root": corpus.root, "listing": corpus.listing()},
                    sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()


def _slug(source: str) -> str:
  name = source.rstrip("/").rsplit("/", 1)[-1]
  name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "corpus"
  return name[:40]


def _is_current(manifest_path: str, fingerprint: str) -> bool:
  try:
    manifest = load_manifest(manifest_path)
  except (OSError, ValueError):
    return False
  root = os.path.dirname(manifest_path)
  names = [manifest["tokenizer"]["file"]] + [s for v in manifest["splits"].values() for s in v["shards"]]
  return manifest["fingerprint"] == fingerprint and all(
      os.path.exists(os.path.join(root, n)) for n in names)


def _unit_hash(key: str) -> float:
  """A uniform number in [0, 1) fixed by the key alone."""
  return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def _choose_validation(keys: list[str], fraction: float, source: str) -> set[str]:
  if not keys:
    raise ValueError(f"data source {source!r} holds no non-empty documents")
  if fraction == 0:
    return set()
  if len(keys) < 2:
    raise ValueError(f"data source {source!r} holds one document: a train/validation split needs "
                     f"two; set data.valid_fraction=0 to train on it without validation")
  u = {k: _unit_hash(k) for k in keys}
  valid = {k for k in keys if u[k] < fraction}
  # A small corpus can miss one side entirely; the extreme hash moves over, still by key alone.
  if not valid:
    valid = {min(keys, key=u.get)}
  if len(valid) == len(keys):
    valid.discard(max(keys, key=u.get))
  return valid


class _ShardWriter:
  """Writes one split as ArrayRecord shards of about SHARD_BYTES each."""

  def __init__(self, out_dir: str, split: str, dtype: np.dtype):
    self.out_dir, self.split, self.dtype = out_dir, split, dtype
    self.shards: list[str] = []
    self.documents = self.tokens = self.text_bytes = 0
    self._writer = None
    self._bytes = 0

  def write(self, ids: np.ndarray, text_bytes: int) -> None:
    if self._writer is None or self._bytes >= SHARD_BYTES:
      self.close()
      name = f"{self.split}-{len(self.shards):05d}.array_record"
      # group_size:1 keeps every record individually addressable for grain's random access.
      self._writer = ArrayRecordWriter(os.path.join(self.out_dir, name), "group_size:1")
      self.shards.append(name)
      self._bytes = 0
    record = ids.astype(self.dtype.newbyteorder("<")).tobytes()
    self._writer.write(record)
    self._bytes += len(record)
    self.documents += 1
    self.tokens += len(ids)
    self.text_bytes += text_bytes

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def summary(self) -> dict:
    return {"shards": self.shards, "documents": self.documents, "tokens": self.tokens,
            "text_bytes": self.text_bytes}


def _build(corpus: Corpus, cfg, settings: dict, fingerprint: str, out_dir: str) -> None:
  def documents():
    return iter_documents(corpus, cfg.format, cfg.text_field, cfg.max_files, cfg.max_bytes)

  # Pass 1: keys only, to fix the split before the tokenizer sees any text.
  keys, content = [], hashlib.sha256()
  for doc in documents():
    keys.append(doc.key)
    content.update(hashlib.sha256(doc.key.encode()).digest())
    content.update(hashlib.sha256(doc.text.encode()).digest())
  valid = _choose_validation(keys, float(cfg.valid_fraction), cfg.source)
  log.info("prepare %s: %d documents, %d for validation", cfg.source, len(keys), len(valid))

  # Pass 2: the tokenizer learns from train text only, so validation stays unseen.
  def train_texts():
    seen = 0
    for doc in documents():
      if doc.key not in valid:
        yield doc.text
        seen += len(doc.text.encode())
        if cfg.tokenizer_train_bytes and seen >= cfg.tokenizer_train_bytes:
          return

  tok = tk.train_tokenizer(train_texts(), int(cfg.vocab_size), image_token=bool(cfg.image_token))
  tk.save_tokenizer(tok, os.path.join(out_dir, TOKENIZER))
  dtype = tk.token_dtype(tok.get_vocab_size())

  # Pass 3: encode and write.
  writers = {s: _ShardWriter(out_dir, s, dtype) for s in SPLITS}
  seen_keys = []
  batch = []

  def flush():
    for doc, ids in zip(batch, tk.encode_documents(tok, [d.text for d in batch]), strict=True):
      writers["validation" if doc.key in valid else "train"].write(ids, len(doc.text.encode()))
    batch.clear()

  for doc in documents():
    seen_keys.append(doc.key)
    batch.append(doc)
    if len(batch) == _ENCODE_BATCH:
      flush()
  flush()
  for w in writers.values():
    w.close()
  if seen_keys != keys:
    raise ValueError(f"data source {cfg.source!r} changed while it was being prepared; run again")

  manifest = {
      "format_version": FORMAT_VERSION,
      "fingerprint": fingerprint,
      "content_sha256": content.hexdigest(),
      "root": corpus.root,
      "settings": settings,
      "files_listed": len(corpus.files),
      "tokenizer": {"file": TOKENIZER, "vocab_size": tok.get_vocab_size(), "pad_id": tk.PAD_ID,
                    "bos_id": tk.BOS_ID, "eos_id": tk.EOS_ID},
      "token_dtype": dtype.name,
      "splits": {s: w.summary() for s, w in writers.items()},
  }
  with open(os.path.join(out_dir, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=2, sort_keys=True)


def _publish(tmp: str, out_dir: str, manifest_path: str, fingerprint: str) -> None:
  if _is_current(manifest_path, fingerprint):
    return  # another process published the same build while this one ran
  stale = None
  if os.path.exists(out_dir):
    stale = f"{out_dir}.stale-{uuid.uuid4().hex}"
    try:
      os.rename(out_dir, stale)
    except FileNotFoundError:
      stale = None  # another process moved it first
  try:
    os.rename(tmp, out_dir)
  except OSError:
    # Another process published first; its build is identical when the fingerprint matches.
    if not _is_current(manifest_path, fingerprint):
      raise
  finally:
    if stale is not None:
      shutil.rmtree(stale, ignore_errors=True)


def _parse_args(argv=None) -> tuple[argparse.Namespace, dict]:
  defaults = default_data_config()
  p = argparse.ArgumentParser(prog="python -m moejax.data.prepare",
                              description="Build tokenizer and ArrayRecord shards for a corpus.")
  p.add_argument("--out", default=None,
                 help="output folder (default: <cache_dir>/<source name>-<fingerprint>)")
  for name in (*_SETTINGS, "cache_dir"):
    default = defaults[name]
    if isinstance(default, bool):
      p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default)
    else:
      p.add_argument(f"--{name}", type=type(default), default=default, help=f"default: {default!r}")
  args = p.parse_args(argv)
  return args, {name: getattr(args, name) for name in (*_SETTINGS, "cache_dir")}


def main(argv=None) -> None:
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  args, fields = _parse_args(argv)
  cfg = default_data_config()
  cfg.update(fields)
  path = prepare(cfg, out_dir=args.out)
  manifest = load_manifest(path)
  print(f"manifest: {path}")
  print(f"tokenizer: vocab {manifest['tokenizer']['vocab_size']}, content {manifest['content_sha256'][:16]}")
  for split, s in manifest["splits"].items():
    print(f"{split}: {s['documents']} documents, {s['tokens']} tokens, {len(s['shards'])} shards")


if __name__ == "__main__":
  main()
