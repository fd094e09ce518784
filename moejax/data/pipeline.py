"""Packed, sharded, checkpointable batches from the prepared shards (grain 0.2.18).

Per process: documents of its shard (every `shard_count`-th record) -> global shuffle, reshuffled
every epoch -> each document BOS..EOS becomes an input/target pair (ids[:-1], ids[1:]) -> grain's
concat-then-split packer cuts the stream into rows of exactly `seq_len` -> rows shuffled in
windows of `shuffle_buffer` (a long document fills many consecutive rows; without this a batch
would often be one file) -> batches of `global_batch_size // shard_count` rows. Validation skips
both shuffles. Each batch is a dict of numpy arrays:

  tokens      [b, T] int32    input ids
  targets     [b, T] int32    next id of the same document (0 = PAD on padding)
  segment_ids [b, T] int32    1, 2, ... per document piece in a row; 0 on padding
  positions   [b, T] int32    position within the segment (0 where a segment starts)
  loss_mask   [b, T] float32  1 on real tokens, 0 on padding

A document longer than the rest of a row is cut, and its remainder opens the next row as a new
segment, so a segment is always a contiguous slice of one document. Inputs and targets are cut
at the same points, hence a target never belongs to another document and every non-padding
position has a real target; padding only appears in the last row of a finite stream.

Checkpointing (the exact 0.2.18 API):
  it = make_iterator(...)
  state = it.get_state()          # a JSON-able dict; it.set_state(state) resumes exactly there
  # with orbax, next to the train state:
  import grain, orbax.checkpoint as ocp
  mngr = ocp.CheckpointManager(dir, item_names=("state", "data"))   # or item_handlers={...}
  mngr.save(step, args=ocp.args.Composite(state=..., data=grain.checkpoint.CheckpointSave(it)))
  mngr.restore(step, args=ocp.args.Composite(state=..., data=grain.checkpoint.CheckpointRestore(it)))
  # the handler is grain.checkpoint.CheckpointHandler; it writes one
  # process_<i>-of-<n>.json per process, so every process saves and restores its own state.
Restoring replays at most one shuffle window of packed rows, so it costs milliseconds.

Several hosts: each process calls `prepare` (via `make_iterator`); with a shared cache_dir they
race safely, with local disks each builds the same bytes. Build once up front with
`python -m moejax.data.prepare` to keep that off the first step.
"""

import functools

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset, WindowShuffleIterDataset

from moejax.data.config import validate_data_config
from moejax.data.prepare import SPLITS, load_manifest, prepare, shard_paths

_PREFETCH = 64  # records read ahead per process when read_threads > 0


def make_iterator(data_cfg, split: str, seq_len: int, global_batch_size: int, seed: int | None = None,
                  shard_index: int | None = None, shard_count: int | None = None,
                  num_epochs: int | None = None, manifest_path: str | None = None
                  ) -> grain.DatasetIterator:
  """This process's batch iterator for `split`, preparing (or finding cached) shards first.

  Train is shuffled, validation is read in order; both repeat forever unless `num_epochs` is set
  (so every process can take the same number of evaluation batches from a fresh iterator). The
  shard defaults are `jax.process_index()` / `jax.process_count()`; `seed` defaults to
  `data_cfg.seed`.
  """
  if shard_index is None or shard_count is None:
    import jax  # only for the defaults: the data code itself never needs jax

    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
  if shard_count < 1 or global_batch_size < 1 or global_batch_size % shard_count:
    raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of the "
                     f"process count {shard_count}")
  validate_data_config(data_cfg)
  manifest_path = manifest_path or prepare(data_cfg)
  ds = make_dataset(manifest_path, split, seq_len=seq_len,
                    batch_size=global_batch_size // shard_count,
                    seed=data_cfg.seed if seed is None else seed, shard_index=shard_index,
                    shard_count=shard_count, shuffle=split == "train", num_epochs=num_epochs,
                    shuffle_buffer=data_cfg.shuffle_buffer, read_threads=data_cfg.read_threads,
                    num_workers=data_cfg.num_workers)
  return iter(ds)


def make_dataset(manifest_path: str, split: str, *, seq_len: int, batch_size: int, seed: int = 0,
                 shard_index: int = 0, shard_count: int = 1, shuffle: bool = True,
                 num_epochs: int | None = None, shuffle_buffer: int = 1024, read_threads: int = 1,
                 num_workers: int = 0) -> grain.IterDataset:
  """The grain pipeline behind `make_iterator`; `batch_size` is per process."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
  if seq_len < 2:
    raise ValueError(f"seq_len={seq_len} must be >= 2")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs={num_epochs} must be >= 1, or None to repeat forever")
  if not 0 <= seed < 2**32:
    raise ValueError(f"seed={seed} must be in [0, 2**32)")

  manifest = load_manifest(manifest_path)
  paths = shard_paths(manifest_path, split)
  if not paths:
    raise ValueError(f"split {split!r} of {manifest_path} has no documents "
                     f"(prepared with valid_fraction={manifest['settings']['valid_fraction']})")
  n_docs = manifest["splits"][split]["documents"]
  if n_docs < shard_count:
    raise ValueError(f"split {split!r} has {n_docs} documents, fewer than the {shard_count} "
                     f"shards (data streams) that share it")
  dtype = np.dtype(manifest["token_dtype"]).newbyteorder("<")

  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  ds = ds[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)  # followed by repeat: each epoch gets its own permutation
  ds = ds.repeat(num_epochs).map(functools.partial(_to_pair, dtype=dtype))
  read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=_PREFETCH if read_threads else 0)
  it = ds.to_iter_dataset(read)
  it = _JsonRoundTripState(ConcatThenSplitIterDataset(it, length_struct={"tokens": seq_len,
                                                                         "targets": seq_len}))
  it = it.map(_finalize)
  if shuffle and shuffle_buffer > 1:
    # Its own seed stream, so rows and documents are not permuted in lockstep.
    it = WindowShuffleIterDataset(it, window_size=shuffle_buffer, seed=(seed + 0x9E3779B9) % 2**32)
  it = it.batch(batch_size, drop_remainder=True)
  if num_workers:
    from absl import flags

    if not flags.FLAGS.is_parsed():
      raise ValueError("num_workers > 0 starts grain worker processes, which read absl flags: run "
                       "under absl.app.run or call absl.flags.FLAGS.mark_as_parsed() first")
    # Each worker packs its own slice of the documents, so the stream depends on num_workers
    # (it stays deterministic and checkpointable for a fixed num_workers).
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return it


def _to_pair(record: bytes, dtype: np.dtype) -> dict[str, np.ndarray]:
  ids = np.frombuffer(record, dtype).astype(np.int32)
  return {"tokens": ids[:-1], "targets": ids[1:]}


def _finalize(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  segment_ids = row["tokens_segment_ids"]
  return {"tokens": row["tokens"], "targets": row["targets"], "segment_ids": segment_ids,
          "positions": row["tokens_positions"], "loss_mask": (segment_ids != 0).astype(np.float32)}


class _JsonRoundTripState(grain.IterDataset):
  """Makes the concat-then-split state survive JSON, as grain's CheckpointHandler stores it.

  In grain 0.2.18 that iterator tests its restored slices against the tuple (-1, -1); JSON
  hands them back as lists, which then never compare equal and restore the wrong position.
  """

  def __iter__(self) -> grain.DatasetIterator:
    return _JsonRoundTripStateIterator(self._parent.__iter__())


class _JsonRoundTripStateIterator(grain.DatasetIterator):

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    state = dict(state)
    state["remainder_slices"] = {k: tuple(v) for k, v in state["remainder_slices"].items()}
    self._parent.set_state(state)
