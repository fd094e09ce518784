"""Checkpoints of an RL run: the train state (as `moejax.training` saves it, so `load_model` reads an RL
workdir too), the frozen reference policy's parameters when there is one, and the loop's own record as
JSON: the iteration, the policy version, the next group id and the paused episodes with their
transcripts. A run restored from it continues as the uninterrupted run would have.
"""

import orbax.checkpoint as ocp

from moejax.training.checkpoint import abstract, orbax_manager


class RLCheckpoints:
  def __init__(self, directory: str, keep: int):
    self._mngr = orbax_manager(directory, keep, {"state": ocp.StandardCheckpointHandler(),
                                                 "reference": ocp.StandardCheckpointHandler(),
                                                 "loop": ocp.JsonCheckpointHandler()})

  def save(self, step: int, state, reference, loop: dict) -> None:
    args = {"state": ocp.args.StandardSave(state), "loop": ocp.args.JsonSave(loop)}
    if reference is not None:
      args["reference"] = ocp.args.StandardSave(reference)
    self._mngr.save(step, args=ocp.args.Composite(**args))
    self._mngr.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def restore(self, step: int, state_template, reference_template):
    """(state, reference or None, loop record) of `step`."""
    args = {"state": ocp.args.StandardRestore(abstract(state_template)), "loop": ocp.args.JsonRestore()}
    if reference_template is not None:
      args["reference"] = ocp.args.StandardRestore(abstract(reference_template))
    restored = self._mngr.restore(step, args=ocp.args.Composite(**args))
    return restored["state"], restored.get("reference") if reference_template is not None else None, \
        restored["loop"]

  def close(self) -> None:
    self._mngr.close()
