"""XLA's memory plan for the train step, or one layer's forward+backward, compiled and never run: what
a step that fails for memory would have asked for, and which buffers make up its peak.

  python -m tools.memory_plan --config experiments/h200.py --seq-len 1048576 --long
  python -m tools.memory_plan --seq-len 1048576 --long --parts kda,mla,moe,ffn --as-gpu
  python -m tools.memory_plan --seq-len 4096 --batch 2 --set model.remat=dots --dump /tmp/plan

Compiling needs no device memory: state and batch are abstract (`jax.eval_shape`). `--long` applies
the settings of step.py's 1M-token step (remat full, routed experts and dense FFNs in 128K-token
pieces, KDA layers in 512K, QK-clip off). `--as-gpu` puts the Pallas kernels in interpret mode, so
that a CPU plan holds the GPU kernels' own buffers rather than those of the XLA reference paths.
`--deviceless` instead compiles the step for an H200 on this machine (tools/deviceless.py): the
GPU compiler's own plan, with the kernels as the GPU runs them.
`--dump DIR` asks XLA for its buffer assignment and prints the buffers live at the peak, largest
first, each with the model part and the name stack of the op that made it
(tools/trace_parts.py), or, where that op has no name, the result type of the instruction that
made it (e.g. `30 x f32[8,131072,512]` for one multi-output fusion).
"""

import argparse
import collections
import contextlib
import glob
import os
import pathlib
import re
import time

GIB = 2**30
PARTS = ("step", "kda", "mla", "moe", "ffn")
_PEAK_SECTION = re.compile(r"Live ranges at \d+ \(peak\):\n((?:\s+\S+: \d+ bytes.*\n)+)")
_PEAK_BUFFER = re.compile(r"^\s+([\w.\-]+)\{[^}]*\}: (\d+) bytes", re.M)
_RESULT = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^\n]*|[a-z]\w*\[[^\]]*\]\S*)", re.M)
_LAYOUT = re.compile(r"\{[^}]*\}")
_COMMENT = re.compile(r"/\*.*?\*/")


def plan_config(args):
  from benchmarks.step_setup import load_config, long_config

  overrides = list(args.set)
  if args.as_gpu:
    overrides = ["model.kda.implementation=interpret", "model.mla.attention=interpret",
                 "model.moe.grouped_matmul=interpret", *overrides]
  config = load_config(args.config, overrides, args.smoke)
  if args.long:
    return long_config(config, args.seq_len)
  config.train.stages = ((args.seq_len, 3, args.seq_len * args.batch),)
  from moejax.config import validate

  return validate(config)


def compile_step(config, batch: int, seq_len: int, sharding=None):
  """The train step as `python -m moejax.train` jits it, compiled for abstract arguments: on the default
  device, or with `sharding` (tools/deviceless.h200_sharding) for the device of its mesh."""
  import jax
  import jax.numpy as jnp

  from benchmarks.step_setup import synthetic_batch
  from moejax.model import build_model
  from moejax.training.state import init_state
  from moejax.training.step import jit_train_step

  model = build_model(config)
  box = {}

  def make():
    state, box["optimizer"], _ = init_state(model, config, jax.random.key(0), 3)
    return state

  state = jax.eval_shape(make)
  data = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, synthetic_batch(config, batch, seq_len, 2048)))
  if sharding is not None:
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    state, data = jax.tree.map(place, state), jax.tree.map(place, data)
  step = jit_train_step(model, box["optimizer"], config, 3)
  with jax.set_mesh(sharding.mesh) if sharding is not None else contextlib.nullcontext():
    return step.lower(state, data).compile()


def compile_part(config, part: str, batch: int, seq_len: int):
  """One layer of `part`, forward and backward, as step.py's component timing runs it."""
  import jax
  import jax.numpy as jnp

  from benchmarks.step_components import layer_fwd_bwd, layer_module

  module, mutable = layer_module(config, part)
  x = jax.ShapeDtypeStruct((batch, seq_len, config.model.d_model), jnp.dtype(config.model.dtype))
  seg = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  variables = jax.eval_shape(module.init, jax.random.key(2), x, seg)
  rest = {k: v for k, v in variables.items() if k != "params"}
  return jax.jit(layer_fwd_bwd(module, mutable)).lower(variables["params"], x, seg, rest).compile()


def peak_buffers(dump_dir: str, module_pattern: str) -> list[tuple[str, int]]:
  """(buffer name, bytes) live at the heap peak, from the newest matching `*live-range.txt` dump."""
  paths = sorted(glob.glob(os.path.join(dump_dir, f"*{module_pattern}*live-range.txt")), key=os.path.getmtime)
  if not paths:
    return []
  m = _PEAK_SECTION.search(pathlib.Path(paths[-1]).read_text())
  if m is None:
    return []
  return sorted(((n, int(b)) for n, b in _PEAK_BUFFER.findall(m.group(1))), key=lambda nb: -nb[1])


def _tuple_items(tuple_type: str) -> list[str]:
  """The top-level items of a parenthesised HLO tuple type, nested brackets and braces kept whole."""
  depth, items, start = 0, [], 1
  for i, ch in enumerate(tuple_type):
    depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
    if depth == 0 or (depth == 1 and ch == ","):
      items.append(tuple_type[start:i].strip())
      start = i + 1
    if depth == 0:
      break
  return items


def result_types(hlo_text: str) -> dict[str, str]:
  """{HLO instruction: its result type without layouts, "N x TYPE" for a tuple of N}: what a buffer
  holds when its op carries no name (XLA's multi-output fusions often have none)."""
  out = {}
  for name, result in _RESULT.findall(_COMMENT.sub("", hlo_text)):
    items = _tuple_items(result) if result.startswith("(") else [result.split(" ")[0]]
    first = _LAYOUT.sub("", items[0]) if items else "()"
    out[name] = f"{len(items)} x {first}" if len(items) > 1 else first
  return out


def peak_table(buffers, names: dict[str, str], top: int, types: dict[str, str] | None = None) -> list[str]:
  """Markdown: the peak's bytes by model part, then its largest buffers (for one without an op name,
  the result type of the instruction that made it, from `types`)."""
  from tools.trace_parts import model_part

  by_part = collections.Counter()
  for name, size in buffers:
    part, direction = model_part(names[name]) if name in names else ("(no op name)", "")
    by_part[f"{part} ({direction})" if direction else part] += size
  total = sum(by_part.values())
  lines = [f"Buffers live at the peak: {len(buffers)}, {total / GIB:.1f} GiB.", "",
           "| part | GiB at the peak | share |", "|---|---|---|"]
  lines += [f"| {p} | {b / GIB:.2f} | {b / total:.1%} |" for p, b in by_part.most_common()]
  lines += ["", f"The {top} largest:", "", "| buffer | GiB | name stack |", "|---|---|---|"]
  for name, size in buffers[:top]:
    stack = names.get(name) or f"(no op name; makes {(types or {}).get(name, '?')})"
    stack = stack if len(stack) <= 120 else "..." + stack[-117:]
    lines.append(f"| `{name}` | {size / GIB:.2f} | `{stack}` |")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(pathlib.Path(__file__).resolve().parent.parent
                                              / "experiments" / "h200.py"))
  parser.add_argument("--set", action="append", default=[], help="config override, e.g. model.remat=dots")
  parser.add_argument("--seq-len", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=1, help="rows (with --long: 1)")
  parser.add_argument("--long", action="store_true", help="step.py's 1M-token settings")
  parser.add_argument("--parts", default="step", help=f"comma-separated, of {PARTS}")
  parser.add_argument("--as-gpu", action="store_true", help="Pallas kernels in interpret mode")
  parser.add_argument("--deviceless", action="store_true",
                      help="compile for an H200 without one (tools/deviceless.py; the step only)")
  parser.add_argument("--dump", default=None, metavar="DIR", help="dump XLA's buffer assignment there")
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes")
  args = parser.parse_args()
  parts = args.parts.split(",")
  if unknown := set(parts) - set(PARTS):
    parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
  if args.long and args.batch != 1:
    parser.error("--long is one row: leave --batch at 1")
  if args.deviceless and (parts != ["step"] or args.as_gpu):
    parser.error("--deviceless compiles the step (--parts step) with the GPU kernels themselves: "
                 "leave out --as-gpu")
  from benchmarks.step import XLA_FLAGS

  # Read when the backend starts, below: the step benchmark's flags, so that the plan is its step's;
  # with --dump, XLA also writes out the modules compiled here.
  xla_flags = [os.environ.get("XLA_FLAGS", ""), XLA_FLAGS]
  if args.dump:
    xla_flags += [f"--xla_dump_to={args.dump}", "--xla_dump_hlo_module_re=.*(train_step|loss).*"]
  os.environ["XLA_FLAGS"] = " ".join(xla_flags)
  import jax

  if args.dump:  # a program found in the persistent compilation cache is not compiled, so not dumped
    jax.config.update("jax_enable_compilation_cache", False)

  from tools.trace_parts import op_names

  config = plan_config(args)
  flags = "".join(f"; --{f.replace('_', '-')}" for f in ("long", "as_gpu", "deviceless") if getattr(args, f))
  sharding, backend = None, contextlib.nullcontext()
  if args.deviceless:
    from tools import deviceless

    sharding, backend = deviceless.h200_sharding(), deviceless.gpu_default_backend()
  device = sharding.mesh.devices.flat[0] if sharding is not None else jax.devices()[0]
  print(f"device {device.device_kind}; {args.batch} x {args.seq_len} tokens; "
        f"overrides {args.set or 'none'}{flags}", flush=True)
  for part in parts:
    t0 = time.perf_counter()
    if part == "step":
      with backend:
        compiled = compile_step(config, args.batch, args.seq_len, sharding)
    else:
      compiled = compile_part(config, part, args.batch, args.seq_len)
    ma = compiled.memory_analysis()
    print(f"{part}: temporaries {ma.temp_size_in_bytes / GIB:.2f} GiB, arguments "
          f"{ma.argument_size_in_bytes / GIB:.2f} GiB, outputs {ma.output_size_in_bytes / GIB:.2f} GiB, "
          f"aliased {ma.alias_size_in_bytes / GIB:.2f} GiB (compiled in {time.perf_counter() - t0:.0f} s)",
          flush=True)
    if args.dump:
      buffers = peak_buffers(args.dump, "train_step" if part == "step" else "loss")
      if not buffers:
        print(f"  no live-range dump with a peak section under {args.dump}", flush=True)
        continue
      text = compiled.as_text()
      table = peak_table(buffers, op_names(text), args.top, result_types(text))
      print("\n".join("  " + line for line in table), flush=True)


if __name__ == "__main__":
  main()
