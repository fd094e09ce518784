"""The `data` sub-config: where the corpus comes from, how it is tokenized, and how it is read.

The lead hangs `default_data_config()` under `config.data`; `validate_data_config` runs before
any data work so a bad field fails with its name instead of deep inside grain or tokenizers.
"""

import os

import ml_collections

from moejax.data import mqar
from moejax.data.tokenizer import MIN_VOCAB_SIZE
from moejax.errors import ConfigError

FORMATS = ("text", "jsonl")


def default_cache_dir() -> str:
  root = os.environ.get("MOEJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moejax")
  return os.path.join(root, "data")


def default_data_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # "stdlib" (this interpreter's standard library sources, no download), a local path, glob or fsspec
  # URL (gs://, s3://, ...) of text files or JSONL files, or "mqar": synthetic associative-recall rows
  # (moejax.data.mqar, set by data.mqar; no corpus, no tokenizer).
  c.source = "stdlib"
  c.mqar = mqar.default_mqar_config()
  c.format = "text"  # "text": one document per file | "jsonl": one document per line
  c.text_field = "text"  # the JSONL key holding the document text
  c.cache_dir = default_cache_dir()
  c.vocab_size = 1024  # byte-level BPE size, special tokens included
  # Reserve the image placeholder <|image|> as token 3 (moejax.data.tokenizer): runs with model.vision.
  c.image_token = False
  # Caps on what is read, in the sorted file order: 0 means no cap. The default keeps the
  # embedded stdlib corpus at about 4 MB so it builds in seconds on two cores.
  c.max_files = 0
  c.max_bytes = 4_000_000
  c.tokenizer_train_bytes = 16_000_000  # BPE is trained on at most this much train text (0: all)
  c.valid_fraction = 0.05  # of documents (files for text, records for JSONL), chosen by path hash
  c.seed = 0  # document shuffle seed (stage i of moejax.train: seed + i); every epoch is reshuffled from it
  c.shuffle_buffer = 1024  # packed rows shuffled together (train only; 0 or 1: off)
  c.read_threads = 1  # grain reader threads per process (0: read synchronously)
  # Disjoint data streams that each step's batch is drawn from, rows / streams rows each
  # (moejax.data.streams): the processes of a run split them, so the data order does not depend on
  # the process count, and any count dividing them can resume the run. 0: one per process of the run's
  # first start. Fixed for the run (workdir/run.json).
  c.streams = 0
  c.num_workers = 0  # grain worker processes (0: none; threads are scarce on small hosts)
  return c


def is_synthetic(c) -> bool:
  """Rows drawn by a generator (data.source "mqar"), not read from a prepared corpus."""
  return c.source == mqar.SOURCE


def validate_data_config(c) -> None:
  """Raises ConfigError naming the offending `data.*` field."""

  def need(cond, msg):
    if not cond:
      raise ConfigError(msg)

  need(isinstance(c.source, str) and c.source.strip() != "", "data.source must be a non-empty string")
  need(c.format in FORMATS, f"data.format={c.format!r} not in {FORMATS}")
  need(not (c.source == "stdlib" and c.format != "text"),
       "data.source='stdlib' reads Python files, so data.format must be 'text'")
  if c.source == mqar.SOURCE:
    need(not c.image_token, "data.source='mqar' has no images: data.image_token must be False")
    mqar.validate_mqar(c.mqar, c.vocab_size)
  need(isinstance(c.image_token, bool), f"data.image_token must be True or False, got {c.image_token!r}")
  need(isinstance(c.text_field, str) and c.text_field != "", "data.text_field must be a non-empty string")
  for name in ("max_files", "max_bytes", "tokenizer_train_bytes", "shuffle_buffer", "read_threads", "streams",
               "num_workers"):
    need(int(c[name]) >= 0, f"data.{name}={c[name]} must be >= 0")
  need(int(c.vocab_size) >= MIN_VOCAB_SIZE,
       f"data.vocab_size={c.vocab_size} is too small: byte-level BPE needs the 256 byte symbols plus "
       f"the special tokens, so at least {MIN_VOCAB_SIZE}")
  need(0.0 <= float(c.valid_fraction) < 1.0, f"data.valid_fraction={c.valid_fraction} must be in [0, 1)")
  need(0 <= int(c.seed) < 2**32, f"data.seed={c.seed} must be in [0, 2**32)")
  need(str(c.cache_dir) != "", "data.cache_dir must be set")
