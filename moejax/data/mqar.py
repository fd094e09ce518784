"""Multi-query associative recall (MQAR): a synthetic source of rows, for training and for evaluation.

A row of length T is one example, drawn from (seed, split, stream, index) alone:

    k_1 v_1 k_2 v_2 ... k_P v_P   then T + 1 - 2P tokens of filler, in which the P keys come back once
                                  each, in a random order, at random places, each followed by its value

The P keys are distinct; values are drawn independently. The loss mask is 1 exactly where the input is a
returning key, so the model is scored only on recalling that key's value: the first P pairs and the
filler are unpredictable. Token ids (within `data.vocab_size`): PAD, BOS, EOS and IMAGE keep 0..3,
then `key_ids` key ids, `value_ids` value ids and `filler_ids` filler ids. A model trained at one length
is evaluated at longer ones with the same P pairs, so only the distance between a pair and its query grows.

Each row dict has the keys of moejax.data.pipeline (tokens, targets, segment_ids, positions, loss_mask).
"""

import ml_collections
import numpy as np

from moejax.errors import ConfigError

SOURCE = "mqar"
FIRST_ID = 4  # after PAD, BOS, EOS and IMAGE (moejax.data.tokenizer)
_SPLIT_IDS = {"train": 0, "validation": 1, "test": 2}


def default_mqar_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.pairs = 16  # key-value pairs an example states, and queries it asks
  c.key_ids = 128  # how many key ids
  c.value_ids = 128  # how many value ids
  c.filler_ids = 64  # how many filler ids (between the queries)
  return c


def vocab_needed(c) -> int:
  """The ids an MQAR source uses: those below this."""
  return FIRST_ID + int(c.key_ids) + int(c.value_ids) + int(c.filler_ids)


def validate_mqar(c, vocab_size: int) -> None:
  """ConfigError naming the data.mqar field at fault."""
  for name in ("pairs", "key_ids", "value_ids", "filler_ids"):
    if int(c[name]) < 1:
      raise ConfigError(f"data.mqar.{name}={c[name]} must be >= 1")
  if int(c.pairs) > int(c.key_ids):
    raise ConfigError(f"data.mqar.pairs={c.pairs} needs as many distinct keys: data.mqar.key_ids={c.key_ids}")
  if vocab_needed(c) > int(vocab_size):
    raise ConfigError(f"data.mqar uses ids up to {vocab_needed(c) - 1} (4 special + keys + values + filler) "
                      f"but data.vocab_size={vocab_size}: raise data.vocab_size or shrink data.mqar")


def min_length(c) -> int:
  """The shortest row that holds an example: the pairs, then every query."""
  return 4 * int(c.pairs)


def example(c, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """One row of `length` tokens (see the module docstring)."""
  P = int(c.pairs)
  if length < min_length(c):
    raise ValueError(f"an MQAR row of {P} pairs needs at least {min_length(c)} tokens, got {length}")
  key_ids = FIRST_ID + rng.choice(int(c.key_ids), size=P, replace=False)
  value_ids = FIRST_ID + int(c.key_ids) + rng.integers(0, int(c.value_ids), size=P)
  filler0 = FIRST_ID + int(c.key_ids) + int(c.value_ids)
  seq = np.empty(length + 1, np.int64)
  seq[0:2 * P:2], seq[1:2 * P:2] = key_ids, value_ids
  seq[2 * P:] = filler0 + rng.integers(0, int(c.filler_ids), size=length + 1 - 2 * P)
  # The queries take P of the two-token slots after the pairs, so a key and its value always both fit.
  slots = np.sort(rng.choice((length + 1 - 2 * P) // 2, size=P, replace=False))
  order = rng.permutation(P)
  at = 2 * P + 2 * slots
  seq[at], seq[at + 1] = key_ids[order], value_ids[order]
  mask = np.zeros(length, np.float32)
  mask[at] = 1.0
  return {"tokens": seq[:-1].astype(np.int32), "targets": seq[1:].astype(np.int32),
          "segment_ids": np.ones(length, np.int32), "positions": np.arange(length, dtype=np.int32),
          "loss_mask": mask}


def example_rng(seed: int, split: str, stream: int, index: int) -> np.random.Generator:
  if split not in _SPLIT_IDS:
    raise ValueError(f"unknown split {split!r}: expected one of {tuple(_SPLIT_IDS)}")
  return np.random.default_rng([int(seed), _SPLIT_IDS[split], int(stream), int(index)])


def batch(c, length: int, rows: int, *, seed: int, split: str, stream: int = 0, start: int = 0) -> dict:
  """Rows start..start+rows-1 of a stream, stacked."""
  parts = [example(c, length, example_rng(seed, split, stream, start + i)) for i in range(rows)]
  return {k: np.stack([p[k] for p in parts]) for k in parts[0]}


class MQARIterator:
  """Batches of one data stream, forever; its state is the index of the next row (JSON, as
  moejax.data.streams checkpoints it)."""

  def __init__(self, c, *, seq_len: int, batch_size: int, seed: int, split: str, stream: int):
    if seq_len < min_length(c):
      raise ConfigError(f"seq_len {seq_len} is too short for data.mqar.pairs={c.pairs}: an example needs "
                        f"{min_length(c)} tokens")
    self.c, self.seq_len, self.batch_size = c, seq_len, batch_size
    self.seed, self.split, self.stream = seed, split, stream
    self.next_row = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    out = batch(self.c, self.seq_len, self.batch_size, seed=self.seed, split=self.split, stream=self.stream,
                start=self.next_row)
    self.next_row += self.batch_size
    return out

  def get_state(self) -> dict:
    return {"next_row": self.next_row}

  def set_state(self, state: dict) -> None:
    self.next_row = int(state["next_row"])
