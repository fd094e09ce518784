"""The full jitted training step: tokens/s, model FLOPs per token, MFU, peak memory, the time of each
component, and one step at T=1M with rematerialisation.

  python -m benchmarks.step --config experiments/h200.py --out BENCHMARKS.md
  python -m benchmarks.step --config experiments/h200.py --only long   # just the 1M-token step
  python -m benchmarks.step --mesh data=2,expert=4 --only step         # 8 devices, expert-parallel
  python -m benchmarks.step --config experiments/h200.py --only components --step-ms 664.9
  python -m benchmarks.step --config experiments/h200.py --only profile  # time per part, from a trace
      (and, in --profile's folder, ops.tsv: every op's time; fusions.txt: the HLO of the costly fusions)
  python -m benchmarks.step --smoke                                    # tiny shapes, any machine

The step runs on a data x expert mesh (default: `expert` over every device, so one GPU is a mesh
of one); the state is placed by `moejax.training.step.state_shardings` and the MoE layers exchange tokens
by all-to-all over `expert`.

Batches are synthetic: uniform random tokens packed into documents of random length (mean
`--mean-doc`), so no data pipeline runs inside the timed loop and the GPU image needs no grain. The
step is `moejax.training.step.jit_train_step`, the one `python -m moejax.train` runs (its state donated, its
XLA options from config.train).

MFU = tokens/s x model FLOPs per token / a rate, given twice: against the card's data-sheet dense bf16
peak (benchmarks/timing.py, SPEC_BF16_PEAK), and against the bf16 matmul rate measured in the same call
(XLA's 8192^3 dot). Model FLOPs per token = 3 x forward: 2 per active matmul weight (routed experts at
top_k/num_experts, the LM head included, the embedding gather not), the chunked KDA form, and MLA's
causal attention within the documents of the timed batch, the pairs its kernels compute on packed rows
(benchmarks/flops.py). Rematerialisation is not counted.

Components are timed alone, forward and backward, on the step's own shapes (one layer each), then
multiplied by how often the model holds them; "rest" is the step minus their sum (AttnRes, the
embedding, the balance update, glue): benchmarks/step_components.py. The config, batches, mesh, state
and FLOP count come from benchmarks/step_setup.py.

The 1M-token step runs first, in a child process, so that its peak memory is its own and the card is
free for it; where a time limit may cut the run off, `--only step` and `--only long` in separate calls
keep the 8K step's table from waiting on the 1M compile.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np

from benchmarks.flops import newton_schulz_flops
from benchmarks.report import replace_section
from benchmarks.step_components import component_table
from benchmarks.step_setup import (
  LONG_SEQ,
  abstract_state,
  init_on_host,
  load_config,
  log,
  long_config,
  make_mesh,
  model_flops_per_token,
  muon_matrices,
  parse_mesh,
  peak_memory_bytes,
  synthetic_batch,
  total_steps,
)
from benchmarks.timing import matmul_rate, spec_bf16_peak
from moejax.config import passes_per_step
from moejax.device_memory import use_default_memory_fraction
from moejax.layers.mla import GatedMLA
from moejax.model import build_model
from moejax.parallel import mesh as meshlib
from moejax.training.muon import NS_STEPS, resolve_ns
from moejax.training.state import state_shardings
from moejax.training.step import jit_train_step
from tools import trace_parts

SECTION = "Training step"
LONG_SECTION = "Training step at 1M tokens"
COMPONENTS_SECTION = "Training step components"
PROFILE_SECTION = "Training step profile"
# Fused kernels at least this long per step get their HLO written next to the profile's op list.
FUSION_MIN_MS = 0.15
PROFILED_STEPS = 2
XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"  # why: main()


def time_steps(config, batch, steps: int, mesh, warmup: int = 1, profile_dir: str | None = None) -> dict:
  """Compiles the train step on `mesh`, runs it once and `warmup` more times, then times `steps` steps
  back to back; with `profile_dir`, then traces two more (tools/trace_parts.py).

  The step compiles from the state's shapes while another thread initialises the state on the host:
  one after the other they took about 35 and 70 s of each H200 call (2026-12-05)."""
  model = build_model(config)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    initialised = pool.submit(init_on_host, model, config)
    shapes, optimizer, axes = abstract_state(model, config)
    shardings = state_shardings(shapes, axes, mesh)
    shapes = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    batch = jax.device_put(batch, meshlib.batch_sharding(mesh))
    log(f"compiling the step on {'x'.join(map(str, batch['tokens'].shape))} tokens")
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      step = jit_train_step(model, optimizer, config, total_steps(config), shardings).lower(shapes, batch)
      step = step.compile()
    compile_s = time.perf_counter() - t0
    # XLA's own plan, known before anything runs: what a step that fails for memory asked for.
    memory = step.memory_analysis()
    if memory is not None:
      gib = lambda n: f"{n / 2**30:.1f} GiB"
      log(f"compiled in {compile_s:.0f} s; XLA's buffers: temporaries "
          f"{gib(memory.temp_size_in_bytes)}, arguments {gib(memory.argument_size_in_bytes)}")
    state = initialised.result()[0]
  log("placing the state on the mesh")
  state = jax.device_put(state, shardings)
  with jax.set_mesh(mesh):
    return {**_time_steps(step, state, batch, steps, optimizer, warmup, profile_dir),
            "compile_s": compile_s, "axes": axes}


def _time_steps(step, state, batch, steps, optimizer, warmup: int, profile_dir: str | None) -> dict:
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  log(f"first step, loss {float(metrics['loss']):.3f}")
  for _ in range(warmup):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  seconds = (time.perf_counter() - t0) / steps
  loss = float(metrics["loss"])
  if not np.isfinite(loss):
    raise FloatingPointError(f"the benchmarked step produced loss {loss}")
  profile = None
  if profile_dir:
    log(f"tracing {PROFILED_STEPS} steps into {profile_dir}")
    events, state = trace_parts.trace_steps(step, state, batch, PROFILED_STEPS, profile_dir)
    hlo_text = step.as_text()
    names = trace_parts.op_names(hlo_text)
    profile = trace_parts.table(events, names, PROFILED_STEPS, seconds * 1e3)
    ops_path, fusions_path = (os.path.join(profile_dir, f) for f in ("ops.tsv", "fusions.txt"))
    rows = trace_parts.write_ops(ops_path, events, names, PROFILED_STEPS)
    with open(fusions_path, "w") as f:
      f.write("\n".join(trace_parts.fusion_bodies(hlo_text, rows, FUSION_MIN_MS)) + "\n")
    log(f"every op's time: {ops_path}; what XLA fused into those of {FUSION_MIN_MS} ms or more: "
        f"{fusions_path}")
  return {"step_s": seconds, "loss": loss, "params": state.params,
          "dropped": float(metrics.get("moe/dropped", 0.0)), "optimizer": optimizer, "state": state,
          "profile": profile}


def run_long(args) -> dict:
  """One rematerialised step at T=LONG_SEQ (its own process: the peak memory is this step's)."""
  config = long_config(load_config(args.config, args.set, args.smoke), args.long_seq)
  m = config.model
  batch = synthetic_batch(config, 1, args.long_seq, args.mean_doc, seed=1)
  # The first run compiled; the second, timed, is already steady (a 1M step takes long enough).
  r = time_steps(config, batch, steps=1, mesh=make_mesh({}), warmup=0)
  mla = GatedMLA(ml_collections.FrozenConfigDict(config.model))
  return {"seq_len": args.long_seq, "step_s": r["step_s"], "compile_s": r["compile_s"], "loss": r["loss"],
          "peak_bytes": peak_memory_bytes(), "moe_chunk": m.moe.token_chunk,
          "ffn_chunk": m.ffn.token_chunk, "kda_chunk": m.kda.seq_chunk,
          "mla_attention": mla.implementation(packed=True)}


def first_stage(args):
  """(config, seq_len, tokens per step, synthetic batch) of the config's first training stage."""
  config = load_config(args.config, args.set, args.smoke)
  seq_len, _, tokens = config.train.stages[0]
  return config, seq_len, tokens, synthetic_batch(config, tokens // seq_len, seq_len, args.mean_doc)


def bench_step(args, device, write) -> list[str]:
  config, seq_len, tokens, batch = first_stage(args)
  matmul_n = 512 if args.smoke else 8192
  peak_rate = matmul_rate(matmul_n)
  log(f"device {device}; bf16 matmul rate {peak_rate / 1e12:.1f} TFLOP/s")
  sizes = parse_mesh(args.mesh) if args.mesh is not None else {"expert": len(jax.devices())}
  mesh = make_mesh(sizes)
  n_dev = mesh.size
  passes = passes_per_step(seq_len, tokens, config.train.microbatch_tokens)
  if (tokens // seq_len // passes) % meshlib.token_shards(mesh):
    raise ValueError(f"{tokens // seq_len // passes} rows per pass do not split over the mesh's "
                     f"{meshlib.token_shards(mesh)} token shards")
  r = time_steps(config, batch, args.steps, mesh)
  peak = peak_memory_bytes()
  mem = "n/a" if peak is None else f"{peak / 2**30:.1f} GiB"
  flops = model_flops_per_token(config, r["params"], batch["segment_ids"])
  tokens_per_s = tokens / r["step_s"]
  mfu = tokens_per_s * flops["total"] / (peak_rate * n_dev)
  spec = spec_bf16_peak(device)
  mfu_spec = "n/a (card not in benchmarks/timing.py)" if spec is None else \
      f"{tokens_per_s * flops['total'] / (spec * n_dev):.1%}"
  step_ms = r["step_s"] * 1e3
  mesh_text = " x ".join(f"{a}={n}" for a, n in dict(mesh.shape).items() if n > 1) or "one device"
  log(f"mesh {mesh_text}: step {step_ms:.1f} ms, {tokens_per_s:,.0f} tokens/s "
      f"({tokens_per_s / n_dev:,.0f} per device), {flops['total'] / 1e9:.2f} GFLOP/token, "
      f"MFU {mfu_spec} of the spec peak, {mfu:.1%} of the measured matmul rate, peak memory {mem}, "
      f"compile {r['compile_s']:.0f} s, dropped {r['dropped']:.0f}")
  in_passes = f"; {passes} passes of {tokens // passes} tokens each" if passes > 1 else ""
  lines = [
      f"`{args.config}` at seq_len {seq_len}, {tokens} tokens per step ({tokens // seq_len} rows{in_passes}) "
      f"of synthetic packed documents (mean length {args.mean_doc}), {args.steps} timed steps, mesh "
      f"{mesh_text}. Peak memory is device 0's"
      + ("." if args.no_components else "; components are timed alone on one device."),
      "", "| figure | value |", "|---|---|",
      f"| step time | {step_ms:.1f} ms |", f"| tokens/s | {tokens_per_s:,.0f} |",
      f"| tokens/s per device | {tokens_per_s / n_dev:,.0f} |",
      *(f"| model FLOPs/token: {k} | {v / 1e9:.3f} G |" for k, v in flops.items()),
      f"| bf16 matmul rate (XLA {matmul_n}^3, same call) | {peak_rate / 1e12:.1f} TFLOP/s |",
      f"| spec dense bf16 peak | {'n/a' if spec is None else f'{spec / 1e12:.1f} TFLOP/s'} |",
      f"| **MFU** against the spec peak (per device) | **{mfu_spec}** |",
      f"| **MFU** against the measured matmul rate (per device) | **{mfu:.1%}** (target 35%) |",
      f"| peak memory | {mem} |",
      f"| compile | {r['compile_s']:.0f} s |", f"| dropped tokens | {r['dropped']:.0f} |",
      *optimizer_rows(config, r["params"], r["axes"], flops["total"] * tokens, mesh)]
  # Written now, so that the step's figures survive a run cut off while it times the components.
  write(SECTION, lines + ["", "Components: not timed (the run ended before them)."])
  if args.no_components:
    return lines
  return lines + component_table(config, batch, r["state"], r["optimizer"], step_ms, mesh)


def optimizer_rows(config, params, axes, model_flops: float, mesh) -> list[str]:
  """Muon's orthogonalisation work per step, which MFU (model FLOPs) leaves out."""
  matrices = muon_matrices(config, params, axes)
  if not matrices:
    return []
  with jax.set_mesh(mesh):
    kernels = resolve_ns(config.optim.muon_ns_implementation) != "xla"
  ns = newton_schulz_flops(matrices, NS_STEPS, symmetric=kernels)
  return [f"| optimizer FLOPs (Muon Newton-Schulz in {config.optim.muon_ns_dtype}"
          f"{', symmetric products halved' if kernels else ''}, "
          f"{sum(b for b, _, _ in matrices):,} matrices; not in MFU) "
          f"| {ns / 1e12:.2f} T per step ({ns / model_flops:.0%} of the model's) |"]


def bench_components(args) -> list[str]:
  """The components alone, without the full step (whose figures come from an earlier `--only step`
  run, passed as --step-ms, or none): for a device call too short for both."""
  config, seq_len, tokens, batch = first_stage(args)
  state, optimizer, _ = init_on_host(build_model(config), config,
                                     " (for the LM head and the optimizer update)")
  where = f" (the step time, {args.step_ms} ms, is from an earlier run)" if args.step_ms else ""
  return [f"`{args.config}` at seq_len {seq_len}, {tokens} tokens per step, one device{where}.",
          *component_table(config, batch, state, optimizer, args.step_ms, make_mesh({}))]


def bench_profile(args) -> list[str]:
  """The step on one device, timed, then PROFILED_STEPS more traced (main turns CUDA graphs off)."""
  config, seq_len, tokens, batch = first_stage(args)
  r = time_steps(config, batch, args.steps, make_mesh({}), profile_dir=args.profile)
  return [f"`{args.config}` at seq_len {seq_len}, {tokens} tokens per step, one device, with XLA's command "
          f"buffers (CUDA graphs) off, so that every kernel names the HLO op that launched it: step time "
          f"{r['step_s'] * 1e3:.1f} ms in this run. {PROFILED_STEPS} steps traced by jax.profiler after "
          f"{args.steps} timed ones; each kernel is charged to the model part in its op's name stack "
          f"(tools/trace_parts.py).", "", *r["profile"]]


def bench_long(args) -> list[str]:
  cmd = [sys.executable, "-m", "benchmarks.step", "--long-child", "--config", args.config, "--long-seq",
         str(args.long_seq), "--mean-doc", str(args.mean_doc), *(f"--set={s}" for s in args.set)]
  # The 1M-token step needs most of the card: let XLA's allocator take more than its default 75%.
  env = dict(os.environ)
  use_default_memory_fraction(env)
  # The child's progress is passed through as it comes, so a run cut off by a time limit still shows
  # how far the 1M-token step got.
  proc = subprocess.Popen(cmd + (["--smoke"] if args.smoke else []), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=pathlib.Path(__file__).resolve().parents[1])
  out, tail = [], []
  for line in proc.stdout:
    if line.startswith("LONG "):
      out.append(line)
      continue
    print(f"  [1M child] {line}", end="", flush=True)
    tail = (tail + [line.rstrip()])[-40:]
  returncode = proc.wait()
  if returncode or not out:
    last = tail[-1] if tail else ""
    log(f"the {args.long_seq}-token step failed (exit {returncode})")
    return [f"One step at T={args.long_seq:,} with remat: **failed** (exit {returncode}): `{last}`"]
  r = json.loads(out[0][len("LONG "):])
  mem = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f} GiB"
  pieces = lambda n: f"{n:,}-token pieces" if n else "whole"
  text = (f"One step at T={r['seq_len']:,} (one row, remat full; routed experts {pieces(r['moe_chunk'])}, "
          f"dense FFNs {pieces(r['ffn_chunk'])}, KDA layers {pieces(r['kda_chunk'])}; "
          f"MLA attention `{r['mla_attention']}`, "
          f"QK-clip off): {r['step_s']:.1f} s, peak memory {mem}, compile {r['compile_s']:.0f} s, "
          f"loss {r['loss']:.3f}.")
  log(text)
  return [text]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(pathlib.Path(__file__).resolve().parent.parent
                                              / "experiments" / "h200.py"))
  parser.add_argument("--set", action="append", default=[], help="config override, e.g. model.remat=full")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--mean-doc", type=int, default=2048, help="mean document length of the batches")
  parser.add_argument("--long-seq", type=int, default=LONG_SEQ)
  parser.add_argument("--only", choices=("step", "long", "components", "profile"), default=None)
  parser.add_argument("--step-ms", type=float, default=None,
                      help="with --only components: the step time to share the components of")
  parser.add_argument("--no-components", action="store_true", help="time the step, not its parts alone")
  parser.add_argument("--profile", default="/tmp/moejax_step_trace", metavar="DIR",
                      help="with --only profile: where the trace goes")
  parser.add_argument("--mesh", default=None, help="e.g. data=2,expert=4 (default: expert over all devices)")
  parser.add_argument("--long-child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU); prints, writes no table")
  parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "BENCHMARKS.md"))
  args = parser.parse_args()
  # Read when the backend starts, below (and by the 1M child, which runs this too). XLA autotunes each
  # dot fusion over dozens of its own Triton GEMM variants, compiling each. With it on, the H200 step
  # had not finished compiling after 225 s (how much of that was this autotuning is not measured);
  # cuBLAS takes the dense matmuls instead. experiments/h200.py asks the same for its train step
  # (train.xla_triton_gemm), so that `python -m moejax.train` compiles it as this runs it; the flag here
  # covers this script's other programs too (the matmul rate, the components).
  # A kernel launched from a CUDA graph is traced without its HLO op, so the profile runs without them.
  no_graphs = "--xla_gpu_enable_command_buffer=" if args.only == "profile" else ""
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), XLA_FLAGS, no_graphs])
  # Parameters drawn with the RBG generator (XLA's RngBitGenerator) instead of threefry: the same
  # distributions, and on a CPU, where `init_on_host` runs, the h200.py state's initialisation took
  # 36 s instead of 77 (compile + run, 2 cores). Training keeps threefry. (On the H200 itself RBG did
  # not shorten it: 135-152 s either way, hence the host.)
  jax.config.update("jax_default_prng_impl", "rbg")
  if args.smoke:
    args.long_seq, args.steps, args.mean_doc = min(args.long_seq, 1024), min(args.steps, 2), 100
  if args.long_child:
    print("LONG " + json.dumps(run_long(args)), flush=True)
    return

  # The 1M-token child runs first, while this process holds no GPU memory: a JAX process keeps the
  # memory its allocator took until it exits, and the child needs most of the card.
  long_lines = bench_long(args) if args.only in (None, "long") else None
  # Then this process may take as much of the card as `python -m moejax.train` does, not XLA's default
  # 75% (moejax/device_memory.py).
  use_default_memory_fraction()
  device = jax.devices()[0].device_kind
  command = "python -m benchmarks.step " + " ".join(sys.argv[1:])

  def write(title, lines):
    body = "\n".join([f"Command: `{command}`  ", f"Date: {datetime.date.today()}, device: {device}.", "",
                      *lines])
    if args.smoke:
      print(f"## {title}\n\n{body}")
    else:
      replace_section(args.out, title, body)
      log(f"wrote the '{title}' section of {args.out}")

  if args.only == "components":
    write(COMPONENTS_SECTION, bench_components(args))
    return
  if args.only == "profile":
    write(PROFILE_SECTION, bench_profile(args))
    return
  if long_lines is not None:
    write(LONG_SECTION, long_lines)
  if args.only in (None, "step"):
    write(SECTION, bench_step(args, device, write))


if __name__ == "__main__":
  main()
