"""One mesh checked and planned, or every factorisation of the GPU count searched for the fastest that fits.

A mesh is admissible when the config's own rules accept it: `moejax.config.validate` with the mesh in
`train.mesh` (each stage's rows per pass split over data x fsdp x expert, the experts over expert), and
`state_shardings` placing every parameter (each split dimension divisible). Its plan: the state's
per-device bytes (`state_bytes`), the activation estimate of every stage (`activations`), the FLOPs and
collectives of a step (`traffic`), and from them a step time: compute at the assumed MFU plus every
collective at its link's rate, not overlapped (the overlapped bound, the larger of the two, is given too).
"""

import copy
import dataclasses
import math

from moejax.config import passes_per_step, validate
from moejax.errors import ConfigError
from moejax.layout import layer_layout
from moejax.parallel.mesh import MESH_AXES, TOKEN_AXES
from moejax.planning import PlanError
from moejax.planning.activations import Pass, activation_bytes
from moejax.planning.hardware import GIB, Card, Links
from moejax.planning.state_bytes import StateLayout, abstract_state, shape_key, state_layout
from moejax.planning.traffic import TokenFlops, moe_all_to_all, step_transfers, token_flops, transfer_seconds

_FLOPS: dict[str, TokenFlops] = {}


@dataclasses.dataclass(frozen=True)
class Options:
  gpus: int
  card: Card
  links: Links = Links()
  mfu: float = 0.35


def mesh_text(sizes: dict[str, int]) -> str:
  return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES)


def parse_mesh(text: str, gpus: int) -> dict[str, int]:
  """"fsdp=8,expert=64,tensor=4" -> all four axes (unnamed ones 1), checked against `gpus`."""
  sizes, named = dict.fromkeys(MESH_AXES, 1), set()
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, sep, value = part.partition("=")
    if not sep or name.strip() not in MESH_AXES:
      raise PlanError(f"--mesh: {part!r} is not axis=size with an axis of {', '.join(MESH_AXES)}")
    if name.strip() in named:
      raise PlanError(f"--mesh: axis {name.strip()} is named twice")
    named.add(name.strip())
    if not value.strip().isdigit() or int(value) < 1:
      raise PlanError(f"--mesh: axis {name.strip()} needs a positive integer size, got {value!r}")
    sizes[name.strip()] = int(value)
  if math.prod(sizes.values()) != gpus:
    raise PlanError(f"--mesh {mesh_text(sizes)} has {math.prod(sizes.values())} devices, not --gpus={gpus}")
  return sizes


def factorisations(gpus: int) -> list[dict[str, int]]:
  """Every (data, fsdp, expert, tensor) whose product is `gpus`."""
  divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
  out = []
  for d in divisors:
    for f in (f for f in divisors if (gpus // d) % f == 0):
      for e in (e for e in divisors if (gpus // (d * f)) % e == 0):
        out.append({"data": d, "fsdp": f, "expert": e, "tensor": gpus // (d * f * e)})
  return out


def prepared(config):
  """A validated copy of `config` (derived fields such as model.vocab_size filled in), its mesh left to
  the planner."""
  config = copy.deepcopy(config)
  config.train.mesh.update(dict.fromkeys(MESH_AXES, 1))
  try:
    return validate(config)
  except ConfigError as e:
    raise PlanError(f"the config is invalid: {e}") from None


def admissible(config, sizes: dict[str, int], trial=None) -> StateLayout | str:
  """The state's layout on the mesh, or why the config's rules refuse the mesh. `trial`: a copy of the
  config for the mesh's validation, reused between calls (validating a validated config changes
  nothing but what the mesh decides)."""
  trial = copy.deepcopy(config) if trial is None else trial
  trial.train.mesh.update(sizes)
  try:
    validate(trial)
  except ConfigError as e:
    return str(e)
  try:
    return state_layout(abstract_state(config), sizes, layer_layout(trial.model).repeats)
  except ValueError as e:  # moejax.parallel.mesh.named_sharding: a split that does not divide
    return str(e)


def _flops(config) -> TokenFlops:
  key = shape_key(config)
  if key not in _FLOPS:
    _FLOPS[key] = token_flops(config)
  return _FLOPS[key]


def stage_plan(config, layout: StateLayout, stage, options: Options) -> dict:
  """Activations, FLOPs, collectives and step time of one (seq_len, steps, tokens_per_batch) stage."""
  m, sizes = config.model, layout.sizes
  seq_len, steps, batch_tokens = stage
  passes = passes_per_step(seq_len, batch_tokens, config.train.microbatch_tokens)
  row_shards = math.prod(sizes[a] for a in TOKEN_AXES)
  rows = batch_tokens // seq_len // passes // row_shards
  one_pass = Pass(rows=rows, seq_len=seq_len, tensor=sizes["tensor"], pass_tokens=batch_tokens // passes)
  acts = activation_bytes(m, one_pass, sizes["expert"], sizes["tensor"])
  step_tokens = one_pass.tokens * passes  # on one device
  flops = _flops(config)
  device_flops = step_tokens * flops.per_device(seq_len, sizes["tensor"])
  compute_s = device_flops / (options.card.peak_flops * options.mfu)
  transfers = [dict(what=t.what, axes=",".join(t.axes), bytes=t.bytes,
                    seconds=transfer_seconds(t, sizes, options.links))
               for t in step_transfers(m, layout, step_tokens, passes) if t.bytes]
  comm_s = sum(t["seconds"] for t in transfers)
  step_s = compute_s + comm_s
  return dict(seq_len=seq_len, steps=steps, tokens_per_batch=batch_tokens, passes=passes,
              rows_per_pass=batch_tokens // seq_len // passes, rows_per_device_per_pass=rows,
              activation_bytes=acts, activations_total_bytes=sum(acts.values()),
              model_flops_per_token=flops.total(seq_len), matmul_flops_per_token=flops.routed + flops.split,
              attention_flops_per_token=flops.attention(seq_len), kda_flops_per_token=flops.kda,
              device_flops_per_step=device_flops,
              all_to_all_bytes=moe_all_to_all(m, sizes, step_tokens), transfers=transfers,
              compute_s=compute_s, communication_s=comm_s, step_s=step_s,
              step_overlapped_s=max(compute_s, comm_s), tokens_per_s=batch_tokens / step_s,
              tokens_per_s_overlapped=batch_tokens / max(compute_s, comm_s))


def plan_mesh(config, layout: StateLayout, options: Options) -> dict:
  """The plan of an admissible mesh: memory per GPU (peak over the stages) and each stage's step."""
  stages = [stage_plan(config, layout, tuple(s), options) for s in config.train.stages]
  # Two layers' weights gathered at once (the one computing and the next, prefetched), and one layer's
  # gradients at that size before their reduction.
  gathered = 2 * layout.layer_gathered_bytes() + layout.layer_gathered_bytes(gradient=True)
  memory = {"parameters": layout.param_bytes, "gradients": layout.gradient_bytes,
            "optimizer state": layout.optimizer_bytes, "other state": layout.other_bytes,
            "gathered weights + gradients": gathered,
            "activations (largest stage)": max(s["activations_total_bytes"] for s in stages)}
  total = sum(memory.values())
  return dict(mesh=dict(layout.sizes), memory_bytes=memory, total_bytes=total,
              usable_bytes=options.card.usable_bytes, fits=total <= options.card.usable_bytes,
              stages=stages, job_seconds=sum(s["step_s"] * s["steps"] for s in stages))


def _over(plan: dict, card: Card) -> str:
  memory = plan["memory_bytes"]
  largest = max(memory, key=memory.get)
  over = plan["total_bytes"] - card.usable_bytes
  return (f"needs {plan['total_bytes'] / GIB:,.1f} GiB per GPU against the {card.name}'s "
          f"{card.usable_bytes / GIB:,.1f} GiB usable: {over / GIB:,.1f} GiB over (largest part: {largest}, "
          f"{memory[largest] / GIB:,.1f} GiB)")


def check_mesh(config, sizes: dict[str, int], options: Options) -> dict:
  config = prepared(config)
  layout = admissible(config, sizes)
  if isinstance(layout, str):
    raise PlanError(f"mesh {mesh_text(sizes)} breaks the config's rules: {layout}")
  plan = plan_mesh(config, layout, options)
  if not plan["fits"]:
    raise PlanError(f"mesh {mesh_text(sizes)} does not fit: it {_over(plan, options.card)}",
                    {**plan, "chosen_by": "given"})
  return {**plan, "chosen_by": "given"}


def search(config, options: Options) -> dict:
  """The admissible mesh of `options.gpus` devices that fits the card with the shortest job."""
  config = prepared(config)
  refused, plans, trial = {}, [], copy.deepcopy(config)
  for sizes in factorisations(options.gpus):
    layout = admissible(config, sizes, trial)
    if isinstance(layout, str):
      refused[mesh_text(sizes)] = layout
    else:
      plans.append(plan_mesh(config, layout, options))
  if not plans:
    shown = list(refused.items())
    reasons = "; ".join(f"{mesh}: {why}" for mesh, why in (shown[0], shown[-1]))
    hint = (" (more rows per pass: a larger batch in --config.train.stages, or fewer GPUs)"
            if any("row shards" in why for why in refused.values()) else "")
    raise PlanError(f"no mesh of {options.gpus} GPUs satisfies the config's divisibility rules "
                    f"({len(refused)} factorisations), e.g. {reasons}{hint}")
  fitting = [p for p in plans if p["fits"]]
  if not fitting:
    closest = min(plans, key=lambda p: p["total_bytes"])
    raise PlanError(f"no mesh of {options.gpus} GPUs fits ({len(plans)} admissible): the smallest, "
                    f"{mesh_text(closest['mesh'])}, {_over(closest, options.card)}",
                    {**closest, "chosen_by": "search: the smallest, which does not fit"})
  best = min(fitting, key=lambda p: p["job_seconds"])
  return {**best, "chosen_by": "search", "admissible_meshes": len(plans), "fitting_meshes": len(fitting),
          "refused_meshes": len(refused)}
