"""The planner behind `python -m moejax.plan`: per-GPU memory and step time of a config on a mesh of many
GPUs, without those GPUs.

* `state_bytes`: the train state's per-device bytes, from the abstract shapes of the real state placed on
  an AbstractMesh by the run's own `state_shardings`;
* `activations`: a per-layer estimate of the activations a pass keeps, from the config's dimensions;
* `traffic`: the FLOPs and the bytes each GPU sends per step (MoE all-to-all, FSDP gathers, gradient
  reductions, tensor-parallel all-reduces), and their times at stated rates (`hardware`);
* `search`: one mesh checked, or every factorisation of the GPU count searched, into a `Plan`.

docs/plan.md states every assumption.
"""


class PlanError(Exception):
  """What the planner cannot plan: a bad mesh, or one that does not fit. The message is one line;
  `plan` is the plan of the mesh that does not fit (the given one, or the search's smallest), if any."""

  def __init__(self, message: str, plan: dict | None = None):
    super().__init__(message)
    self.plan = plan
