"""Checkpoints of the whole train state plus the grain data iterator, through orbax.

Saves are asynchronous and keep the newest N. Restore walks back from the newest step: a checkpoint
that cannot be read (a partial write, a corrupt file) is skipped with a warning, so a crash during a
save costs the steps since the previous checkpoint, never the run.
"""

import logging

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger("moejax.checkpoint")


class Manager:
  def __init__(self, directory: str, keep: int):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                           cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(
        directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": grain.checkpoint.CheckpointHandler()})

  def save(self, step: int, state, data_iterator) -> None:
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)))

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def restore_latest(self, state_template, iterator_for_step):
    """(state, data iterator) from the newest readable checkpoint, or None if there is none.

    iterator_for_step(step) builds a fresh iterator of the right stage for the grain state to be
    loaded into: the stage, and so the sequence length, depends on the step.
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state_template)
    for step in sorted(self._mngr.all_steps(), reverse=True):
      data_iterator = iterator_for_step(step)
      try:
        restored = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract),
            data=grain.checkpoint.CheckpointRestore(data_iterator)))
      except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back the same way
        log.warning("checkpoint at step %d is unreadable (%s: %s); trying the previous one",
                    step, type(e).__name__, e)
        continue
      return restored["state"], data_iterator
    return None
