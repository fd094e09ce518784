"""Where a jitted function spends its device time: a jax.profiler trace of a few calls, with each
kernel charged to the model part whose JAX name stack launched it.

The trace's kernel events carry the HLO instruction that launched them (the `hlo_op` argument, or
failing that the kernel's own name, which XLA gives its fusions). The compiled module's HLO text maps
each instruction to its `op_name` metadata, the name stack, e.g.
`jit(train_step)/transpose(jvp(Transformer))/layer_5/moe/router/dot_general`. `model_part` turns
that into a part ("MoE / router") and a direction ("forward" under jvp, "backward" under its
transpose); the named scopes of moejax's layers and train step give the parts their names.

  events, state = trace_steps(compiled_step, state, batch, calls=2, log_dir="/tmp/trace")
  lines = table(events, op_names(compiled_step.as_text()), calls=2)

`fusion_bodies` then prints, for the costliest fused kernels, the HLO that XLA put in each.
"""

import collections
import glob
import gzip
import json
import os
import re

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_OPERAND = re.compile(r"\(%?([\w.\-]+)")
_LAYER = re.compile(r"(?:^|[/(])layer_\d+\)*/([A-Za-z_]+\d*)(?:/(.*))?$")
# Layer sub-modules and the part each one is charged to.
_MODULES = {"kda": "KDA", "mla": "MLA", "moe": "MoE", "ffn": "dense FFN", "mixer_attnres": "AttnRes",
            "ffn_attnres": "AttnRes", "mixer_norm": "pre-norms", "ffn_norm": "pre-norms"}
# Named scopes inside a part (moejax.layers.*, moejax.training.step) that get their own row.
_SCOPES = ("qkv_conv", "gates", "chunk_kda", "output", "router", "latent_down", "sort_gather",
           "grouped_glu", "combine", "latent_up", "quantile_balance", "shared_0")
_CLASSES = {"KDA": "KDA", "GatedMLA": "MLA", "MoE": "MoE", "SiTUGLU": "dense FFN"}
_TOP_SCOPES = {"optimizer": "optimizer update", "lm_head_loss": "LM head + loss",
               "accumulate": "gradient accumulation"}


def op_names(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name: op_name metadata} for the instructions of a module's text.

  An instruction without metadata of its own (XLA drops it on many fusions and copies) takes that of
  the computation it calls (its root's, or failing that the first found), or else its first operand's.
  """
  own, calls, operand, computation_ops = {}, {}, {}, {}
  current = None
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      c = _COMPUTATION.match(line)
      if c is not None:
        current = c.group(1)
      continue
    name, rest = m.groups()
    op = _OP_NAME.search(rest)
    if op:
      own[name] = op.group(1)
      if current is not None and (line.lstrip().startswith("ROOT") or current not in computation_ops):
        computation_ops[current] = op.group(1)
    if (c := _CALLS.search(rest)) is not None:
      calls[name] = c.group(1)
    if (o := _OPERAND.search(rest.split("metadata=")[0])) is not None:
      operand[name] = o.group(1)
  names = dict(own)
  for name in set(calls) | set(operand):
    if name in names:
      continue
    seen, at = set(), name
    while at not in names and at not in seen:  # follow first operands back to an op that has a name
      seen.add(at)
      if calls.get(at) in computation_ops:
        names[at] = computation_ops[calls[at]]
        break
      at = operand.get(at)
      if at is None:
        break
    if at in names:
      names[name] = names[at]
  return names


def model_part(op_name: str) -> tuple[str, str]:
  """(part, direction) of a name stack: part like "MoE / router" or "optimizer update"; direction
  "forward", "backward" (under a transpose: the VJP) or "" (neither, as the optimizer)."""
  direction = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else ""
  # A scope entered inside a transformation shows up wrapped: "transpose(jvp(lm_head_loss))/...".
  scopes = set(re.split(r"[/()]", op_name))
  for scope, part in _TOP_SCOPES.items():
    if scope in scopes:
      return part, direction
  if re.match(r"(state|batch)\b", op_name):  # XLA names copies of an argument after its path
    return "copies of the step's arguments", direction
  m = _LAYER.search(op_name)
  if m is not None:
    part = _MODULES.get(m.group(1), "layer glue (residual adds, casts)")
    inner = set(re.split(r"[/()]", m.group(2) or ""))
  else:  # a layer compiled alone: its module's class name wraps its name stack, as in "jvp(KDA)"
    part = next((p for cls, p in _CLASSES.items() if cls in scopes), None)
    if part is None:
      if "Transformer" in scopes:
        return "model, outside the layers (embedding, final AttnRes)", direction
      return "other (outside the model and the named parts)", direction
    inner = scopes
  sub = next((s for s in _SCOPES if s in inner), None)
  return (f"{part} / {sub}" if sub else part), direction


def kernel_events(trace: dict) -> list[tuple[str, str, str, float]]:
  """(hlo_module, hlo_op or "", kernel name, microseconds) of every kernel on the first device's
  streams, or of every host event that names an HLO op when the trace has no device (the CPU)."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  devices = sorted(pid for pid, name in procs.items() if name.startswith("/device:"))
  out = []
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    args = e.get("args", {})
    if devices:
      # A device's kernels sit on its "Stream #..." lines; its other lines are summaries of them.
      if e["pid"] != devices[0] or not threads.get((e["pid"], e["tid"]), "").startswith("Stream"):
        continue
    elif "hlo_op" not in args:
      continue
    out.append((args.get("hlo_module", ""), args.get("hlo_op", ""), e["name"], float(e["dur"])))
  return out


def load_trace(log_dir: str) -> dict:
  paths = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto trace under {log_dir}")
  with gzip.open(paths[-1], "rt") as f:
    return json.load(f)


def attribute(events, names: dict[str, str]) -> dict:
  """Microseconds per (part, direction), per HLO op, and what could not be attributed."""
  by_part, by_op = collections.Counter(), collections.Counter()
  op_of = {}
  # A GPU kernel that XLA generated for a fusion is named after it, with "." and "-" made "_".
  by_kernel_name = {re.sub(r"[.\-]", "_", n): n for n in names}
  for _, hlo_op, kernel, us in events:
    instruction = (hlo_op if hlo_op in names else kernel if kernel in names
                   else by_kernel_name.get(kernel))
    if instruction is None:
      key = ("unattributed kernels", "")
      label = f"(unattributed) {kernel[:60]}"
    else:
      key = model_part(names[instruction])
      label = instruction
      op_of[label] = names[instruction]
    by_part[key] += us
    by_op[label] += us
  return {"parts": by_part, "ops": by_op, "op_names": op_of}


def table(events, names: dict[str, str], calls: int, wall_ms: float | None = None,
          top: int = 20) -> list[str]:
  """Markdown: time per call of each model part, forward and backward, then the costliest ops."""
  a = attribute(events, names)
  total_ms = sum(a["parts"].values()) / 1e3 / calls
  parts = collections.defaultdict(dict)
  for (part, direction), us in a["parts"].items():
    parts[part][direction] = us / 1e3 / calls
  wall = ""
  if wall_ms:
    gap = ("the device idles between kernels for the rest" if wall_ms > total_ms
           else "kernels overlap, on several streams or threads")
    wall = f" against {wall_ms:.1f} ms of wall time ({gap})"
  lines = [f"Kernel time per call: {total_ms:.1f} ms{wall}.", "",
           "| part | forward ms | backward ms | other ms | total ms | share of kernel time |",
           "|---|---|---|---|---|---|"]
  for part, d in sorted(parts.items(), key=lambda kv: -sum(kv[1].values())):
    total = sum(d.values())
    cells = [f"{d[k]:.2f}" if k in d else "" for k in ("forward", "backward", "")]
    lines.append(f"| {part} | {' | '.join(cells)} | {total:.2f} | {total / total_ms:.1%} |")
  lines += ["", f"The {top} costliest HLO ops:", "", "| op | ms per call | share | name stack |",
            "|---|---|---|---|"]
  for op, us in a["ops"].most_common(top):
    stack = a["op_names"].get(op, "")
    stack = stack if len(stack) <= 110 else "..." + stack[-107:]
    lines.append(f"| `{op}` | {us / 1e3 / calls:.2f} | {us / 1e3 / calls / total_ms:.1%} | `{stack}` |")
  return lines


def write_ops(path: str, events, names: dict[str, str], calls: int) -> list[tuple]:
  """Every op's time per call, costliest first, as tab-separated op, ms, part, direction, name stack:
  the whole list behind `table`'s top few, for reading offline. Returns those rows (ms as floats)."""
  a = attribute(events, names)
  rows = []
  for op, us in a["ops"].most_common():
    stack = a["op_names"].get(op, "")
    part, direction = model_part(stack) if stack else ("unattributed kernels", "")
    rows.append((op, us / 1e3 / calls, part, direction, stack))
  with open(path, "w") as f:
    f.write("op\tms_per_call\tpart\tdirection\tname_stack\n")
    f.writelines(f"{op}\t{ms:.4f}\t{part}\t{direction}\t{stack}\n" for op, ms, part, direction, stack in rows)
  return rows


_METADATA = re.compile(r",\s*metadata=\{[^}]*\}|,\s*backend_config=(?:\{.*\}|\"[^\"]*\")(?=,|$)")
_LIBRARY_CALLS = ("custom-call", "cublas", "pallas_call", "triton", "cudnn")


def computations(hlo_text: str) -> dict[str, list[str]]:
  """{computation name: its lines, the header first} of a module's text."""
  out, current = {}, None
  for line in hlo_text.splitlines():
    if current is None:
      c = _COMPUTATION.match(line)
      if c is not None and not line.startswith(" "):
        current = c.group(1)
        out[current] = [line]
    elif line.strip() == "}":
      current = None
    else:
      out[current].append(line)
  return out


def fusion_bodies(hlo_text: str, ops_rows, min_ms: float, max_lines: int = 80) -> list[str]:
  """What XLA put in each costly fused kernel: for every op of `ops_rows` (write_ops's rows: op, ms per
  call, part, direction, name stack) of at least min_ms that is not a library call (cuBLAS, custom calls,
  Pallas kernels), its instruction and the fused computation it calls, metadata stripped. This is how
  one sees that a fusion writes float32 copies nobody asked for, or that XLA merged a reduction with
  unrelated element-wise outputs."""
  comps = computations(hlo_text)
  instructions = {}
  for lines in comps.values():
    for line in lines[1:]:
      m = _INSTRUCTION.match(line)
      if m is not None:
        instructions.setdefault(m.group(1), line)
  strip = lambda line: _METADATA.sub("", line).rstrip()
  out = []
  for op, ms, part, direction, stack in ops_rows:
    if float(ms) < min_ms or op.startswith(_LIBRARY_CALLS):
      continue
    out += ["", f"== {op}: {float(ms):.3f} ms per call, {part} {direction}".rstrip(), f"   {stack}"]
    line = instructions.get(op)
    if line is None:
      out.append("   (not in this module)")
      continue
    out.append(strip(line))
    called = _CALLS.search(line.split("metadata=")[0])
    body = comps.get(called.group(1), []) if called else []
    out += [strip(x) for x in body[:max_lines]]
    if len(body) > max_lines:
      out.append(f"   ... {len(body) - max_lines} more lines")
  return out


def trace_steps(step, state, batch, calls: int, log_dir: str):
  """Runs `state, _ = step(state, batch)` `calls` times under the profiler. Returns the kernel events
  of the step's module (the one that took the most time; the trace also holds small transfers) and
  the last state (the step may donate its input)."""
  import jax

  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for _ in range(calls):
      state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
  return main_module_events(kernel_events(load_trace(log_dir))), state


def main_module_events(events):
  """The kernel events of the module that took the most time (a trace also holds small transfers and
  other programs), and those that name no module."""
  modules = collections.Counter()
  for module, _, _, us in events:
    modules[module] += us
  main = modules.most_common(1)[0][0] if modules else ""
  return [e for e in events if e[0] == main or not e[0]]
