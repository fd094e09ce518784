"""Checkpoints of the whole train state plus the position of every data stream, through orbax, on a
local disk or an object store (moejax.storage).

Saves are asynchronous and keep the newest N. Restore walks back from the newest step: a checkpoint
that cannot be read (a partial write, a corrupt file) is skipped with a warning and moved aside
(the run will save that step again), so a crash during a save costs the steps since the previous
checkpoint, never the run. When checkpoints exist but none can be read, restore raises instead of
starting over: that is usually a changed config, and a fresh run would bury the old one.
"""

import logging
import time

import jax
import orbax.checkpoint as ocp
from etils import epath

from moejax.data.streams import StreamsCheckpointHandler, StreamsRestore, StreamsSave
from moejax.errors import ConfigError
from moejax.storage import move, orbax_s3, resolve_workdir

log = logging.getLogger("moejax.training.checkpoint")


def orbax_manager(directory: str, keep: int, item_handlers: dict) -> ocp.CheckpointManager:
  """orbax's manager of `directory` (local, made absolute, or an object-store URL) for the named items,
  saving in the background and keeping the newest `keep`; a partial save's temporary folder is cleaned."""
  directory = resolve_workdir(directory)  # orbax refuses relative paths
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                         cleanup_tmp_directories=True, **orbax_s3.manager_options(directory))
  return ocp.CheckpointManager(directory, options=options, item_handlers=item_handlers)


def abstract(tree):
  """The shapes, dtypes and shardings of a tree of arrays: what orbax restores into."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Manager:
  def __init__(self, directory: str, keep: int):
    self.directory = epath.Path(resolve_workdir(directory))
    self._mngr = orbax_manager(
        directory, keep, {"state": ocp.StandardCheckpointHandler(), "data": StreamsCheckpointHandler()})

  def save(self, step: int, state, data_iterator) -> None:
    """`data_iterator`: a moejax.data.streams.StreamIterator, whose streams' positions are saved."""
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=StreamsSave(data_iterator)))

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mngr.all_steps())

  def restore(self, step: int, state_template, data_iterator):
    """(state, data_iterator) of one step; the grain state is loaded into `data_iterator`."""
    restored = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract(state_template)), data=StreamsRestore(data_iterator)))
    return restored["state"], data_iterator

  def restore_latest(self, state_template, iterator_for_step):
    """(state, data iterator) from the newest readable checkpoint, or None if there is none.

    iterator_for_step(step) builds a fresh iterator of the right stage for the grain state to be
    loaded into: the stage, and so the sequence length, depends on the step.
    """
    unreadable = []
    for step in reversed(self.all_steps()):
      iterator = iterator_for_step(step)  # outside the try: a data error is the run's, not the checkpoint's
      try:
        restored = self.restore(step, state_template, iterator)
      except (jax.errors.JaxRuntimeError, ConfigError):
        raise  # the device's (e.g. out of memory) or the run's settings', not the checkpoint's
      except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back the same way
        log.warning("checkpoint at step %d is unreadable (%s: %s); trying the previous one",
                    step, type(e).__name__, e)
        unreadable.append(step)
        continue
      for bad in unreadable:
        self._move_aside(bad)
      return restored
    if unreadable:
      raise RuntimeError(f"none of the checkpoints {sorted(unreadable)} in {self.directory} can be "
                         f"restored into this run's state (see the warnings above); a changed config "
                         f"is the usual cause. Move them away to start over.")
    return None

  def _move_aside(self, step: int) -> None:
    """Out of the manager's directory, so the step can be saved again; kept for inspection."""
    aside = self.directory.parent / f"{self.directory.name}.unreadable"
    target = aside / f"{step}-{int(time.time())}"
    move(str(self.directory / str(step)), str(target))
    log.warning("moved the unreadable checkpoint of step %d to %s", step, target)
    self._mngr.reload()
