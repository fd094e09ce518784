"""A run's data as a fixed number of streams, independent of how many processes read them.

The global batch of a step is the concatenation, in stream order, of `rows / streams` rows from
each of `streams` disjoint data streams (stream k reads every `streams`-th record, from the k-th).
Process p of P reads streams [p*S/P, (p+1)*S/P): a contiguous block, so the global batch (and the
losses) are the same whatever the process count, and a checkpoint saves one data position per
stream (`stream_<k>-of-<S>.json`), which any process count dividing S can restore. grain's own
orbax handler saves one file per process instead, and so loses the data position when the process
count changes.

    it = StreamIterator({k: make_stream(k) for k in owned_streams(S, p, P)})
    batch = next(it)   # this process's rows: its streams' batches concatenated
"""

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from moejax.errors import ConfigError


def owned_streams(streams: int, process_index: int, process_count: int) -> range:
  """The block of streams process `process_index` of `process_count` reads."""
  if streams < 1 or streams % process_count:
    raise ConfigError(f"the run's {streams} data streams do not split over {process_count} processes: "
                      f"run a process count that divides {streams} (data.streams, fixed when the run "
                      f"started; see workdir/run.json)")
  per = streams // process_count
  return range(process_index * per, (process_index + 1) * per)


def rows_per_stream(rows: int, streams: int, where: str) -> int:
  if rows % streams:
    raise ConfigError(f"{where} has {rows} rows, which do not split over the run's {streams} data streams "
                      f"(data.streams)")
  return rows // streams


class StreamIterator:
  """This process's batches: one batch from each of its streams, concatenated along rows."""

  def __init__(self, iterators: dict[int, Any], total: int):
    self.iterators = dict(sorted(iterators.items()))
    self.total = total

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    parts = [next(it) for it in self.iterators.values()]
    if len(parts) == 1:
      return parts[0]
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

  def file_name(self, stream: int) -> str:
    return f"stream_{stream}-of-{self.total}.json"

  def get_state(self) -> dict:
    return {self.file_name(k): it.get_state() for k, it in self.iterators.items()}

  def set_state(self, state: dict) -> None:
    for k, it in self.iterators.items():
      it.set_state(state[self.file_name(k)])


class StreamsCheckpointHandler(ocp.CheckpointHandler):
  """Orbax handler of a StreamIterator: every process writes and reads the files of its own streams."""

  def save(self, directory: epath.Path, args: "StreamsSave"):
    for name, state in args.item.get_state().items():
      (directory / name).write_text(json.dumps(state))

  def restore(self, directory: epath.Path, args: "StreamsRestore"):
    it = args.item
    state = {}
    for k in it.iterators:
      path = directory / it.file_name(k)
      if not path.exists():
        saved = sorted(p.name for p in directory.iterdir() if p.name.startswith("stream_"))
        raise ConfigError(f"{path} is missing: the checkpoint holds the data positions {saved}, not those "
                          f"of this run's {it.total} streams")
      state[it.file_name(k)] = json.loads(path.read_text())
    it.set_state(state)
    for inner in it.iterators.values():
      if hasattr(inner, "start_prefetch"):
        inner.start_prefetch()
    return it

  def structure(self, directory):
    return None

  def metadata(self, directory):
    return None

  def finalize(self, directory):
    pass

  def close(self):
    pass


@ocp.args.register_with_handler(StreamsCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StreamsSave(ocp.args.CheckpointArgs):
  item: StreamIterator


@ocp.args.register_with_handler(StreamsCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StreamsRestore(ocp.args.CheckpointArgs):
  item: StreamIterator


def stream_iterator(make: Callable[[int], Any], streams: int, process_index: int,
                    process_count: int) -> StreamIterator:
  """StreamIterator over `make(k)` for this process's streams k."""
  return StreamIterator({k: iter(make(k)) for k in owned_streams(streams, process_index, process_count)},
                        streams)
