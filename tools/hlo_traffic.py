"""The HBM traffic of a compiled step, read off its HLO: what each kernel writes and reads, by model part
and dtype, the activation-sized float32 buffers that pass between kernels, and the kernel launches.

A static count, no timing: each kernel (a fusion, a library call, a copy) writes its outputs and reads its
operands once, whole. That misses in-kernel re-reads and counts in-place updates in full, so it is a
floor-side estimate per kernel; its use is to compare two versions of the step (did a change remove a
float32 round trip?) and to point the profiler at parts whose time is far above their bytes.

`--deviceless` compiles the step here for an H200 that this machine does not have (benchmarks/
deviceless.py, which says how to install what that needs), with step.py's XLA flags:

  JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python -m tools.hlo_traffic --deviceless \
      --config experiments/h200.py --hlo-out /tmp/step.hlo --out /tmp/traffic.md

(about 2 minutes on two CPU cores). `--hlo FILE` reads a compiled module's text instead.
"""

import argparse
import collections
import dataclasses
import math
import pathlib
import re
import sys
import time

from tools.trace_parts import computations, model_part, op_names

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")
_REF = re.compile(r"%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEES = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|called_computations)="
                      r"(\{[^}]*\}|%?[\w.\-]+)")
_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}
# Ops that launch no kernel of their own: views, tuples, control flow (their bodies are counted), and
# the second half of an async pair.
_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
                "call", "after-all", "partition-id", "replica-id", "opt-barrier", "fusion-done", "copy-done",
                "async-done", "all-reduce-done", "all-gather-done", "collective-permute-done", "send-done",
                "recv-done", "add-dependency", "domain"}


def dtype_bytes(dtype: str) -> int:
  """Bytes per element of an HLO element type (sub-byte types count as one)."""
  if dtype in _BYTES:
    return _BYTES[dtype]
  return max(int(re.sub(r"\D", "", dtype.split("e")[0]) or 8) // 8, 1)


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    return self.size * dtype_bytes(self.dtype)


@dataclasses.dataclass
class Kernel:
  name: str
  opcode: str
  outputs: list[Array]
  operands: list[str]  # instruction names
  op_name: str
  times: int  # launches per step (a loop body's trip count)


def _split_type(rest: str) -> tuple[str, str]:
  """(the result type, what follows it) of an instruction's right-hand side."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _arrays(type_text: str) -> list[Array]:
  return [Array(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text)]


def _tuple_elements(type_text: str) -> list[str]:
  """The top-level element types of a tuple type "(a, (b, c), d)"."""
  inner, parts, depth, start = type_text.strip()[1:-1], [], 0, 0
  for i, ch in enumerate(inner):
    depth += ch in "({["
    depth -= ch in ")}]"
    if ch == "," and depth == 0:
      parts.append(inner[start:i])
      start = i + 1
  return parts + [inner[start:]]


def _operand_text(body: str) -> str:
  """The parenthesised operand list right after the opcode."""
  start = body.find("(")
  depth = 0
  for i in range(start, len(body)):
    depth += body[i] == "("
    depth -= body[i] == ")"
    if depth == 0:
      return body[start + 1:i]
  return body[start + 1:]


def _instructions(lines):
  """(name, opcode, what follows the result type, the result type) of each instruction line."""
  for line in lines:
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    name, rest = m.groups()
    type_text, body = _split_type(rest)
    yield name, body.split("(", 1)[0].strip(), body, type_text


def kernels(hlo_text: str) -> tuple[list[Kernel], dict[str, list[Array]]]:
  """Every kernel launch of a compiled module, and {instruction: its result arrays} for all of them.

  Kernels are the instructions of the computations that run on the device's stream (the entry, loop
  bodies and conditions, branches), not those inside fusions, which a fusion's own launch covers. A loop
  body's kernels count `known_trip_count` times (once where XLA does not know it)."""
  comps = computations(hlo_text)
  names = op_names(hlo_text)
  types: dict[str, list[Array]] = {}
  parsed: dict[str, list[tuple[str, str, str, str]]] = {}
  fused, children = set(), collections.defaultdict(list)  # children: (computation, trip count)
  entry = None
  for comp, lines in comps.items():
    if lines[0].startswith("ENTRY"):
      entry = comp
    rows = []
    for name, opcode, body, type_text in _instructions(lines[1:]):
      types[name] = _arrays(type_text)
      rows.append((name, opcode, body, type_text))
      trip = _TRIP.search(body)
      for key, target in _CALLEES.findall(body):
        for callee in _REF.findall(target) or [target.lstrip("%")]:
          runs_inside = opcode == "fusion" or opcode.endswith("-start") or key == "called_computations" \
              or (key == "to_apply" and opcode != "call")  # a reduce's or a sort's comparator
          if runs_inside:
            fused.add(callee)  # part of this instruction's own kernel
          elif key == "condition" and trip:
            continue  # XLA runs a loop of known trip count without evaluating its condition
          else:  # loop bodies and conditions, branches, and calls (e.g. XLA's command buffers)
            children[comp].append((callee, int(trip.group(1)) if trip and key == "body" else 1))
    parsed[comp] = rows
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  out, stack = [], [(entry, 1)]  # HLO has no recursion; a computation called twice counts twice
  while stack:
    comp, times = stack.pop()
    if comp in fused or comp not in parsed:
      continue
    for name, opcode, body, type_text in parsed[comp]:
      if opcode in _NOT_KERNELS:
        continue
      operands = _REF.findall(_operand_text(body))
      outputs = types[name]
      if opcode.endswith("-start"):
        # An async start's type is (its operands, its result, context...): it writes the result only.
        outputs = _arrays(_tuple_elements(type_text)[1])
      out.append(Kernel(name, opcode, outputs, operands, names.get(name, ""), times))
    stack.extend((child, times * n) for child, n in children.get(comp, ()))
  return out, types


def _skip(array: Array) -> bool:
  """cuBLAS and cuDNN workspaces, which come back as s8/u8 outputs of their calls."""
  return array.dtype in ("s8", "u8")


def traffic(hlo_text: str) -> dict:
  """{(part, direction, dtype): [bytes written, bytes read]} over the module's kernels, per step."""
  ks, types = kernels(hlo_text)
  table = collections.defaultdict(lambda: [0, 0])
  for k in ks:
    part, direction = model_part(k.op_name)
    for a in k.outputs:
      if not _skip(a):
        table[(part, direction, a.dtype)][0] += a.nbytes * k.times
    for op in k.operands:
      for a in types.get(op, ()):
        if not _skip(a):
          table[(part, direction, a.dtype)][1] += a.nbytes * k.times
  return dict(table)


def _views(hlo_text: str) -> dict:
  """{get-tuple-element or bitcast: (the instruction it views, the tuple index or None)}."""
  views = {}
  for name, opcode, body, _ in _instructions(hlo_text.splitlines()):
    if opcode in ("get-tuple-element", "bitcast") and (src := _REF.findall(_operand_text(body))):
      index = re.search(r"\bindex=(\d+)", body) if opcode == "get-tuple-element" else None
      views[name] = (src[0], int(index.group(1)) if index else None)
  return views


def wide_buffers(hlo_text: str, min_elements: int, dtype: str = "f32") -> list[tuple]:
  """The kernel outputs of `dtype` with at least min_elements elements and how many kernel launches
  read each: [(part, direction, Array, reads, producer, op_name)], largest first."""
  ks, _ = kernels(hlo_text)
  views = _views(hlo_text)

  def source(name):
    index = None
    while name in views:
      name, i = views[name]
      index = i if i is not None else index
    return name, index or 0

  reads = collections.Counter()
  for k in ks:
    for op in set(k.operands):
      reads[source(op)] += k.times
  rows = []
  for k in ks:
    for i, a in enumerate(k.outputs):
      if a.dtype == dtype and a.size >= min_elements:
        rows.append((*model_part(k.op_name), a, reads[(k.name, i)], k.name, k.op_name))
  return sorted(rows, key=lambda r: (-r[2].size, r[0]))


def part_totals(hlo_text: str) -> collections.Counter:
  """{(part, direction): bytes written + read} per step."""
  totals = collections.Counter()
  for (part, direction, _), (w, r) in traffic(hlo_text).items():
    totals[(part, direction)] += w + r
  return totals


def launch_counts(hlo_text: str) -> collections.Counter:
  """{(part, direction): kernel launches per step}: each of `kernels` times its loop trip counts."""
  counts = collections.Counter()
  for k in kernels(hlo_text)[0]:
    counts[model_part(k.op_name)] += k.times
  return counts


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


def report(hlo_text: str, min_elements: int, title: str, baseline: str | None = None) -> list[str]:
  """Markdown: traffic by part, the activation-sized float32 buffers by part, and with `baseline` (another
  module's text) each part's total against it."""
  table = traffic(hlo_text)
  parts = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
  for (part, direction, dtype), (w, r) in table.items():
    parts[(part, direction)][dtype][0] += w
    parts[(part, direction)][dtype][1] += r
  both = lambda d, dtype: sum(d[dtype]) if dtype in d else 0
  total = lambda d: sum(w + r for w, r in d.values())
  lines = [f"## {title}", "",
           "Static HBM traffic per step, GiB: each kernel writes its outputs and reads its operands once.",
           "",
           "| part | direction | written | read | float32 | bf16 |", "|---|---|---|---|---|---|"]
  for (part, direction), d in sorted(parts.items(), key=lambda kv: -total(kv[1])):
    w, r = (sum(x[i] for x in d.values()) for i in (0, 1))
    lines.append(f"| {part} | {direction} | {_gib(w)} | {_gib(r)} | {_gib(both(d, 'f32'))} | "
                 f"{_gib(both(d, 'bf16'))} |")
  by_dtype = lambda dt: sum(sum(v) for (_, _, t), v in table.items() if t == dt)
  written, read = (sum(v[i] for v in table.values()) for i in (0, 1))
  f32, bf16 = by_dtype("f32"), by_dtype("bf16")
  lines += [f"| **all** | | {_gib(written)} | {_gib(read)} | {_gib(f32)} | {_gib(bf16)} |", "",
            f"Kernel launches per step: {sum(launch_counts(hlo_text).values()):,}.", ""]
  wide = wide_buffers(hlo_text, min_elements)
  by_part = collections.defaultdict(lambda: [0, 0, 0])
  for part, direction, a, reads, _, _ in wide:
    row = by_part[(part, direction)]
    row[0] += 1
    row[1] += a.nbytes
    row[2] += a.nbytes * reads
  lines += [f"Float32 kernel outputs of {min_elements:,} elements or more: {len(wide)}, "
            f"{_gib(sum(a.nbytes for _, _, a, _, _, _ in wide))} GiB written, "
            f"{_gib(sum(a.nbytes * n for _, _, a, n, _, _ in wide))} GiB read by later kernels.", "",
            "| part | direction | buffers | GiB written | GiB read |", "|---|---|---|---|---|"]
  for (part, direction), (n, w, r) in sorted(by_part.items(), key=lambda kv: -kv[1][2]):
    lines.append(f"| {part} | {direction} | {n} | {_gib(w)} | {_gib(r)} |")
  lines.append("")
  if baseline is not None:
    before, after = part_totals(baseline), part_totals(hlo_text)
    lines += ["Against the baseline module (GiB, written + read):", "",
              "| part | direction | baseline | this |", "|---|---|---|---|"]
    for key in sorted(set(before) | set(after), key=lambda k: after[k] - before[k]):
      if abs(after[key] - before[key]) >= 2**28:  # a quarter GiB
        lines.append(f"| {key[0]} | {key[1]} | {_gib(before[key])} | {_gib(after[key])} |")
    lines += [f"| **all** | | {_gib(sum(before.values()))} | {_gib(sum(after.values()))} |", ""]
    before, after = launch_counts(baseline), launch_counts(hlo_text)
    lines += ["Kernel launches per step against the baseline module (parts whose count moved):", "",
              "| part | direction | baseline | this |", "|---|---|---|---|"]
    for key in sorted(set(before) | set(after), key=lambda k: after[k] - before[k]):
      if after[key] != before[key]:
        lines.append(f"| {key[0]} | {key[1]} | {before[key]:,} | {after[key]:,} |")
    lines += [f"| **all** | | {sum(before.values()):,} | {sum(after.values()):,} |", ""]
  return lines


def compile_deviceless(config_path: str, overrides: list[str]) -> str:
  """The HLO text of the train step of `config_path` at its first stage's shape, compiled for an H200."""
  from benchmarks.step_setup import load_config
  from tools import deviceless
  from tools.memory_plan import compile_step

  deviceless.use_step_flags()
  config = load_config(config_path, overrides)
  seq_len, _, tokens = config.train.stages[0]
  sharding = deviceless.h200_sharding()
  t0 = time.perf_counter()
  with deviceless.gpu_default_backend():
    compiled = compile_step(config, tokens // seq_len, seq_len, sharding)
  print(f"compiled for {sharding.mesh.devices.flat[0].device_kind} in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr)
  return compiled.as_text()


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--hlo", help="a compiled module's HLO text")
  src.add_argument("--deviceless", action="store_true", help="compile the step for an H200 here")
  p.add_argument("--config", default="experiments/h200.py")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
  p.add_argument("--hlo-out", help="with --deviceless: where to save the compiled module's text")
  p.add_argument("--baseline", help="another module's HLO text, to compare each part's traffic with")
  p.add_argument("--min-elements", type=int, default=1 << 24,
                 help="the size from which a float32 kernel output counts as activation-sized")
  p.add_argument("--title", default="Step HBM traffic (static, from the HLO)")
  p.add_argument("--out", help="also write the report here (markdown)")
  args = p.parse_args(argv)
  if args.hlo_out and not args.deviceless:
    p.error("--hlo-out saves what --deviceless compiles")
  if args.hlo:
    text = pathlib.Path(args.hlo).read_text()
  else:
    text = compile_deviceless(args.config, args.set)
    if args.hlo_out:
      pathlib.Path(args.hlo_out).write_text(text)
  baseline = pathlib.Path(args.baseline).read_text() if args.baseline else None
  lines = report(text, args.min_elements, args.title, baseline)
  print("\n".join(lines))
  if args.out:
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
