"""Data streams (moejax.data.streams): the global batch does not depend on how many processes read
it, and a checkpoint of the streams' positions restores under another process count."""

import os
import random

import numpy as np
import pytest
from etils import epath

from moejax.data import default_data_config, make_dataset
from moejax.data.prepare import prepare
from moejax.data.streams import (
  StreamIterator,
  StreamsCheckpointHandler,
  StreamsRestore,
  StreamsSave,
  owned_streams,
  stream_iterator,
)
from moejax.errors import ConfigError

STREAMS, ROWS, SEQ = 4, 8, 16


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(1)
  for i in range(24):
    (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(["a", "bc", "def", "\n"]) for _ in range(80)))
  c = default_data_config()
  c.update(source=str(root), cache_dir=str(tmp_path_factory.mktemp("cache")), vocab_size=300, max_bytes=0,
           read_threads=0)
  return prepare(c)


def streams_of(manifest, process: int, processes: int) -> StreamIterator:
  make = lambda k: make_dataset(manifest, "train", seq_len=SEQ, batch_size=ROWS // STREAMS, seed=3,
                                shard_index=k, shard_count=STREAMS, shuffle_buffer=4, read_threads=0)
  return stream_iterator(make, STREAMS, process, processes)


def global_batches(manifest, processes: int, steps: int) -> list[np.ndarray]:
  """The global batches' tokens: each process's rows, concatenated in process order."""
  its = [streams_of(manifest, p, processes) for p in range(processes)]
  return [np.concatenate([next(it)["tokens"] for it in its]) for _ in range(steps)]


def test_the_global_batch_is_the_same_for_any_process_count(manifest):
  one = global_batches(manifest, 1, 5)
  for processes in (2, 4):
    for a, b in zip(one, global_batches(manifest, processes, 5), strict=True):
      np.testing.assert_array_equal(a, b)
  assert one[0].shape == (ROWS, SEQ)


def test_streams_are_split_in_blocks_and_a_count_that_does_not_divide_is_refused():
  assert [list(owned_streams(4, p, 2)) for p in range(2)] == [[0, 1], [2, 3]]
  with pytest.raises(ConfigError, match="4 data streams do not split over 3 processes"):
    owned_streams(4, 0, 3)


@pytest.mark.parametrize("saved_by,restored_by", [(2, 1), (1, 4), (4, 2)])
def test_a_checkpoint_restores_under_another_process_count(manifest, tmp_path, saved_by, restored_by):
  """Each of `saved_by` processes saves its streams' positions after 3 batches into one checkpoint;
  `restored_by` processes restore them and read on as an uninterrupted reader does."""
  want = global_batches(manifest, 1, 5)[3:]
  saving = [streams_of(manifest, p, saved_by) for p in range(saved_by)]
  for it in saving:
    for _ in range(3):
      next(it)
  directory = tmp_path / "data"
  directory.mkdir()
  handler = StreamsCheckpointHandler()
  for it in saving:  # what every process's handler writes into the shared checkpoint folder
    handler.save(epath.Path(directory), StreamsSave(it))
  assert sorted(os.listdir(directory)) == [f"stream_{k}-of-{STREAMS}.json" for k in range(STREAMS)]
  restoring = [handler.restore(epath.Path(directory), StreamsRestore(streams_of(manifest, p, restored_by)))
               for p in range(restored_by)]
  for step, batch in enumerate(want):
    got = np.concatenate([next(it)["tokens"] for it in restoring])
    np.testing.assert_array_equal(got, batch, err_msg=f"batch {3 + step}")


def test_a_checkpoint_of_other_streams_is_refused(manifest, tmp_path):
  directory = epath.Path(tmp_path)
  (directory / "stream_0-of-2.json").write_text("{}")
  with pytest.raises(ConfigError, match="stream_0-of-4.json is missing"):
    StreamsCheckpointHandler().restore(directory, StreamsRestore(streams_of(manifest, 0, 1)))
