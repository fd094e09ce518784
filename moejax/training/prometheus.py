"""Prometheus metrics of a training run, served over HTTP for a Prometheus server to scrape.

Each process of a run serves its own endpoint (`train.metrics_port`), and every series carries the
label `process` (the JAX process index), so the hosts of one run stay apart and a dashboard can pick one.
`MetricsExporter.record` takes the metrics row that the loop hands `Monitor.record` each step:

  step, loss, grad_norm, finite, bad_steps         every step
  val_loss, tokens_per_s, mfu                       on some steps only: the gauge keeps the last value,
                                                    and has no series until the first one
  moe/<layer>/maxvio_batch, .../maxvio_global,      per MoE layer, <layer> being its module path
  .../top_share, .../load (one value per expert)    ("layer_3/moe"), which becomes the label `layer`

The means over layers (moe/maxvio_batch, moe/maxvio_global) are not exported: PromQL's avg() or max()
over `layer` gives them, and the collapse alert wants the worst layer, not the mean. Other row keys
(lr, stage, load_min, ...) are ignored.

Skipped steps are counted from the rows: a row whose `finite` is 0 adds one to
moejax_skipped_steps_total, so the loop needs no extra call. moejax_checkpoint_save_seconds is a gauge of
the last save (`checkpoint_saved`), not a histogram: saves are rare, and the dashboard plots the value.

Cost: a row of L layers x E experts is L*E gauge updates, about 6 ms a step for 64 layers of 256 experts
on one CPU core (0.5 ms for experiments/h200.py). The labelled children are made at a key's first row and
kept: looking a child up by its labels each step would cost several times the update.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

# Row key -> (metric, help): the run-wide scalars.
SCALARS = {
    "step": ("moejax_step", "The last training step recorded."),
    "loss": ("moejax_loss", "Training loss of the last step."),
    "val_loss": ("moejax_val_loss", "Validation loss of the last evaluation."),
    "tokens_per_s": ("moejax_tokens_per_second", "Training throughput (tokens/s) at the last measurement."),
    "mfu": ("moejax_mfu", "Model FLOPs utilisation at the last measurement (0..1)."),
    "grad_norm": ("moejax_grad_norm", "Global gradient norm of the last step."),
    "bad_steps": ("moejax_bad_steps", "Consecutive skipped (non-finite) steps up to the last step."),
}
# Suffix of a per-layer row key moe/<layer>/<suffix> -> (metric, help).
LAYER_SCALARS = {
    "maxvio_batch": ("moejax_moe_maxvio_batch", "MaxVio of this batch's expert load, per MoE layer."),
    "maxvio_global": ("moejax_moe_maxvio_global", "MaxVio of the accumulated expert load, per MoE layer."),
    "top_share": ("moejax_moe_top_expert_share",
                  "Fraction of the batch's tokens that chose the most loaded expert, per MoE layer."),
}
EXPERT_LOAD = "moejax_expert_load"
SKIPPED_STEPS = "moejax_skipped_steps_total"
CHECKPOINT_SECONDS = "moejax_checkpoint_save_seconds"
LAST_STEP_TIMESTAMP = "moejax_last_step_timestamp_seconds"

# Every series name as PromQL sees it (the counter with its _total): what alerts and dashboards may use.
METRIC_NAMES = frozenset([*(m for m, _ in SCALARS.values()), *(m for m, _ in LAYER_SCALARS.values()),
                          EXPERT_LOAD, SKIPPED_STEPS, CHECKPOINT_SECONDS, LAST_STEP_TIMESTAMP])

_MOE_PREFIX = "moe/"
_LOAD_SUFFIX = "load"


class MetricsExporter:
  """Serves the run's metrics at http://<host>:<port>/metrics until `close()`.

  `port` 0 binds a free port; `.port` is the one bound. `registry`: where the metrics live (a new
  CollectorRegistry by default, not prometheus_client's global one, so that several exporters can live
  in one process)."""

  def __init__(self, port: int, process_index: int, registry: CollectorRegistry | None = None,
               addr: str = "0.0.0.0"):
    self.registry = CollectorRegistry() if registry is None else registry
    self.process = str(process_index)
    gauge = lambda name, doc, labels=(): Gauge(name, doc, ["process", *labels], registry=self.registry)
    self._scalars = {key: gauge(name, doc) for key, (name, doc) in SCALARS.items()}
    self._layer_scalars = {suffix: gauge(name, doc, ["layer"])
                           for suffix, (name, doc) in LAYER_SCALARS.items()}
    self._expert_load = gauge(EXPERT_LOAD, "Load of each expert of a MoE layer in the last step, over the "
                              "layer's mean (1 = a fair share).", ["layer", "expert"])
    # prometheus_client appends the _total itself.
    skipped = Counter(SKIPPED_STEPS.removesuffix("_total"), "Steps whose update was skipped because the "
                      "loss or gradient was not finite, in this process.", ["process"],
                      registry=self.registry)
    # Made now, at 0, rather than at the first skip: increase() cannot see the step of a series that
    # appears at 1.
    self._skipped = skipped.labels(self.process)
    self._step = self._scalars["step"].labels(self.process)
    # Its series appears at the first save: a 0 before any would read as a save that took no time.
    self._checkpoint = gauge(CHECKPOINT_SECONDS, "Seconds the last checkpoint save took.")
    self._last_step_time = gauge(LAST_STEP_TIMESTAMP, "Unix time at which the last step was recorded."
                                 ).labels(self.process)
    # Row key -> where its value goes: a gauge child for a scalar, [layer, children by expert] for an
    # expert-load vector, None for keys that are not exported. Resolved once per key.
    self._routes: dict[str, object] = {}
    self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
    self.port = self._server.server_port

  def record(self, step: int, row: dict) -> None:
    """Exports one metrics row of the training loop (floats, and lists of floats for vectors)."""
    self._step.set(step)
    self._last_step_time.set(time.time())
    if not row.get("finite", 1.0):
      self._skipped.inc()
    for key, value in row.items():
      if key not in self._routes:
        self._routes[key] = self._route(key)
      route = self._routes[key]
      if route is None:
        continue
      if isinstance(route, list):
        self._set_loads(route, value)
      elif not isinstance(value, list):  # a scalar metric that came as a vector is not one we know
        route.set(value)

  def checkpoint_saved(self, seconds: float) -> None:
    """Records how long the last checkpoint save took."""
    self._checkpoint.labels(self.process).set(seconds)

  def close(self) -> None:
    """Stops the HTTP server and frees its port; the metrics stay readable through `registry`."""
    if self._server is None:
      return
    self._server.shutdown()
    self._server.server_close()
    self._thread.join(timeout=5)
    self._server = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _route(self, key: str):
    if key in self._scalars:
      # The step comes from record's argument.
      return None if key == "step" else self._scalars[key].labels(self.process)
    if not key.startswith(_MOE_PREFIX):
      return None
    layer, _, suffix = key[len(_MOE_PREFIX):].rpartition("/")
    if not layer:  # moe/maxvio_batch and the other means over layers
      return None
    if suffix == _LOAD_SUFFIX:
      return [layer, []]
    if suffix in self._layer_scalars:
      return self._layer_scalars[suffix].labels(self.process, layer)
    return None

  def _set_loads(self, route: list, loads) -> None:
    layer, children = route
    loads = loads if isinstance(loads, list) else [loads]  # to_row makes a 1-expert vector a float
    while len(children) < len(loads):
      children.append(self._expert_load.labels(self.process, layer, str(len(children))))
    for child, load in zip(children, loads, strict=False):
      child.set(load)
