"""Per-GPU memory and step time of a config trained on many GPUs, planned without them.

python -m moejax.plan --config experiments/k3.py --gpus 2048 --gpu h200 [--mesh fsdp=2,expert=64,tensor=16]

Without --mesh it searches every factorisation of --gpus into data x fsdp x expert x tensor that the
config's rules admit and picks, among those that fit the card, the one with the shortest job. It prints a
table and then, as its last line, the plan as JSON. A mesh that breaks the config's rules or does not fit
the card (or a GPU count with no mesh that fits) ends it with a one-line error and exit status 1; where
there is a plan that does not fit, the table and the JSON come first.

Memory by kind comes from the real train state's abstract shapes placed by the run's `state_shardings`;
activations, FLOPs and collectives are estimates whose assumptions docs/plan.md lists (and moejax/planning).
The rates are stated, and flags override them. The config's own fields override as usual, e.g.
--config.train.stages='((8192, 1000, 16777216),)' --config.train.microbatch_tokens=2097152.
"""

import json
import sys

from moejax.planning import PlanError
from moejax.planning.hardware import CARDS, GIB, Links
from moejax.planning.search import Options, check_mesh, mesh_text, parse_mesh, search

# What the figures rest on, printed with them (docs/plan.md gives the reasons).
ASSUMPTIONS = (
    "state: the real train state's abstract shapes placed by state_shardings; gradients: float32 "
    "accumulators of the params' shapes and placement, once",
    "gathered: two layers' weights gathered for use (one computing, one prefetched) and one layer's "
    "gradients at that size; FSDP gathers over fsdp, the MoE's shard_map over all but the experts' own axis",
    "activations: a per-layer estimate from the config's widths; remat=full keeps each layer's input and "
    "recomputes one layer at a time; AttnRes block sums, and the scan's block buffer once per period; MoE "
    "receive buffers padded to capacity_factor; not counted: the vision tower, XLA temporaries, "
    "fragmentation",
    "FLOPs: 6 x active matmul parameters (count_params; untied embedding and vision tower left out) + MLA "
    "causal attention on rows of one document + KDA's chunked form; the routed experts run whole on every "
    "tensor rank",
    "collectives per pass: weights all-gathered twice in their stored dtype, gradients reduced once; MoE "
    "all-to-all of top_k latent rows a token in the compute dtype, (expert-1)/expert leaving the device, "
    "balanced, nothing dropped; a tensor all-reduce per sublayer output forward, backward and recompute",
    "links: a group within one node at the NVLink rate, a ring across nodes at the InfiniBand rate, an "
    "all-to-all split between the two; step time = compute + collectives, not overlapped",
)


def make_plan(config, options: Options, mesh: str = "") -> dict:
  """The plan of the mesh `mesh` ("" searches for one). Raises PlanError."""
  if mesh:
    return check_mesh(config, parse_mesh(mesh, options.gpus), options)
  return search(config, options)


def _gib(nbytes: float) -> str:
  return f"{nbytes / GIB:,.2f}"


def _stage_lines(i: int, s: dict, options: Options) -> list[str]:
  lines = [f"stage {i}: rows of {s['seq_len']:,} tokens, {s['tokens_per_batch']:,} tokens a step in "
           f"{s['passes']} pass(es) of {s['rows_per_pass']} rows: {s['rows_per_device_per_pass']} row(s) "
           f"per GPU per pass, {s['steps']:,} steps",
           "  activations per GPU (GiB, a per-layer estimate)"]
  lines += [f"    {name:<38}{_gib(b):>12}" for name, b in s["activation_bytes"].items()]
  rate = options.card.peak_flops * options.mfu
  lines += [f"  model FLOPs per token {s['model_flops_per_token'] / 1e9:,.1f} G: 6 x "
            f"{s['matmul_flops_per_token'] / 6e9:,.1f}B active matmul parameters "
            f"(moejax.params.count_params) + MLA attention {s['attention_flops_per_token'] / 1e9:,.1f} G "
            f"+ KDA chunked form {s['kda_flops_per_token'] / 1e9:,.1f} G",
            f"  compute per GPU {s['device_flops_per_step']:.3e} FLOP a step at {options.mfu:.0%} of "
            f"{options.card.peak_flops / 1e12:,.1f} TFLOP/s ({rate / 1e12:,.1f}): {s['compute_s']:,.2f} s",
            "  collectives per GPU per step                 over              GB           s"]
  lines += [f"    {t['what']:<40}{t['axes']:<16}{t['bytes'] / 1e9:>12,.1f}{t['seconds']:>12,.2f}"
            for t in s["transfers"]]
  a2a = s["all_to_all_bytes"]
  lines += [f"    (MoE all-to-all: {a2a['forward + backward'] / 1e9:,.1f} GB dispatch + combine forward and "
            f"backward, {a2a['remat recompute'] / 1e9:,.1f} GB more for the remat recompute)",
            f"  step {s['step_s']:,.2f} s (compute + collectives, not overlapped; "
            f"{s['step_overlapped_s']:,.2f} s if fully overlapped)",
            f"  tokens/s, whole job: {s['tokens_per_s']:,.0f} "
            f"({s['tokens_per_s_overlapped']:,.0f} overlapped)"]
  return lines


def format_table(plan: dict, options: Options) -> str:
  card, links = options.card, options.links
  searched = ""
  if "admissible_meshes" in plan:
    tried = plan["admissible_meshes"] + plan["refused_meshes"]
    searched = (f" ({plan['admissible_meshes']} of {tried} factorisations admissible, "
                f"{plan['fitting_meshes']} fit)")
  lines = [f"{options.gpus} x {card.name}: {card.usable_bytes / GIB:,.1f} GiB usable each "
           f"({card.memory_bytes / GIB:,.1f} GiB x the run's memory fraction)",
           f"mesh {mesh_text(plan['mesh'])}, {plan['chosen_by']}{searched}",
           "memory per GPU                                       GiB"]
  lines += [f"  {name:<38}{_gib(b):>14}" for name, b in plan["memory_bytes"].items()]
  verdict = "fits" if plan["fits"] else "DOES NOT FIT"
  lines.append(f"  {'total':<38}{_gib(plan['total_bytes']):>14}  of {_gib(plan['usable_bytes'])}: {verdict}")
  for i, stage in enumerate(plan["stages"]):
    lines += _stage_lines(i, stage, options)
  lines.append(f"rates: {card.peak_flops / 1e12:,.1f} TFLOP/s dense bf16 per card (data sheet), MFU "
               f"{options.mfu:.0%} (assumed), NVLink {links.nvlink_bytes_per_s / 1e9:,.0f} GB/s within "
               f"{links.gpus_per_node} GPUs, InfiniBand {links.ib_bytes_per_s / 1e9:,.0f} GB/s per GPU "
               "across nodes")
  lines += ["assumptions:"] + [f"  - {a}" for a in ASSUMPTIONS]
  return "\n".join(lines)


def summary(plan: dict, options: Options, gpu: str) -> dict:
  """Every figure of the plan, for the closing JSON line."""
  card, links = options.card, options.links
  return {"gpus": options.gpus, "gpu": gpu, **plan,
          "rates": {"peak_flops": card.peak_flops, "mfu": options.mfu, "memory_bytes": card.memory_bytes,
                    "nvlink_bytes_per_s": links.nvlink_bytes_per_s, "ib_bytes_per_s": links.ib_bytes_per_s,
                    "gpus_per_node": links.gpus_per_node},
          "assumptions": list(ASSUMPTIONS)}


def run(config, *, gpus: int, gpu: str, mesh: str = "", mfu: float = 0.35,
        links: Links | None = None) -> dict:
  """Plans, prints the table and the JSON line, and returns the plan; exits with the error's one line
  (status 1) when the mesh breaks the config's rules or nothing fits."""
  if gpu not in CARDS:
    sys.exit(f"moejax.plan: --gpu={gpu!r} is not one of {sorted(CARDS)}")
  if gpus < 1 or not 0 < mfu <= 1:
    sys.exit(f"moejax.plan: need --gpus >= 1 and 0 < --mfu <= 1, got {gpus} and {mfu}")
  options = Options(gpus=gpus, card=CARDS[gpu], links=links or Links(), mfu=mfu)
  try:
    plan = make_plan(config, options, mesh)
  except PlanError as e:
    if e.plan is not None:
      print(format_table(e.plan, options))
      print(json.dumps(summary(e.plan, options, gpu)))
    sys.exit(f"moejax.plan: {e}")
  print(format_table(plan, options))
  print(json.dumps(summary(plan, options, gpu)))
  return plan


def _define_flags():
  """Only when run as a program: importing this module must not claim the global absl flag names."""
  from absl import flags
  from ml_collections import config_flags

  return dict(
      config=config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=False),
      gpus=flags.DEFINE_integer("gpus", None, "how many GPUs the run takes"),
      gpu=flags.DEFINE_enum("gpu", "h200", sorted(CARDS), "the card"),
      mesh=flags.DEFINE_string("mesh", "", "data=..,fsdp=..,expert=..,tensor=.. (unnamed axes 1); "
                               "empty: search"),
      mfu=flags.DEFINE_float("mfu", 0.35, "assumed model FLOPs utilisation of the spec peak"),
      nvlink=flags.DEFINE_float("nvlink_gbytes_per_s", 450.0, "NVLink, GB/s per GPU per direction"),
      ib=flags.DEFINE_float("ib_gbytes_per_s", 50.0, "InfiniBand, GB/s per GPU across nodes"),
      node=flags.DEFINE_integer("gpus_per_node", 8, "GPUs that NVLink joins"))


def main(argv, f) -> None:
  del argv
  if f["config"].value is None or f["gpus"].value is None:
    sys.exit("usage: python -m moejax.plan --config experiments/k3.py --gpus 2048 [--gpu h200] "
             "[--mesh data=..,fsdp=..,expert=..,tensor=..] [--mfu 0.35]")
  links = Links(nvlink_bytes_per_s=f["nvlink"].value * 1e9, ib_bytes_per_s=f["ib"].value * 1e9,
                gpus_per_node=f["node"].value)
  run(f["config"].value, gpus=f["gpus"].value, gpu=f["gpu"].value, mesh=f["mesh"].value, mfu=f["mfu"].value,
      links=links)


if __name__ == "__main__":
  import os

  import jax
  from absl import app

  # The plan computes nothing on a device: JAX stays off the GPU (and its memory) unless told otherwise.
  # Set through jax.config: JAX read the environment when this module's imports loaded it.
  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", "cpu")
  _flags = _define_flags()
  app.run(lambda argv: main(argv, _flags))
