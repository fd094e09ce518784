"""KDA kernel benchmark: ours (Pallas), ours (XLA reference) and fla 0.6.0 chunk_kda on one GPU.

  python -m benchmarks.kda --section-out $OUT/kda.md     # the issue's table, as a markdown section
  python -m benchmarks.kda --sweep          # per-kernel block sizes and launch parameters
  python -m benchmarks.kda --check          # GPU correctness only (Pallas vs the float32 reference)

fla runs in a child process (torch and JAX apart); inputs and its outputs travel as raw bf16 bits
through /dev/shm. Its first call autotunes each kernel (253 s for two shapes on an H100, more than
220 s for one on an H200: most of a device call). `--fla-tune-cache DIR` keeps the results (Triton's
`*.autotune.json` files) in DIR/<GPU model>; pack them for the next machine with
  (cd DIR && find . -name '*.autotune.json' | tar czf $OUT/fla_tune.tgz -T -)
and unpack them into DIR (`mkdir -p DIR && tar xzf fla_tune.tgz -C DIR`) for the next call, which
carries DIR (e.g. .triton_cache, git-ignored): fla then compiles only the configs it had chosen. On an
H100 the child took a small fraction of the time it takes without the results kept by an earlier run
(BENCHMARKS.md, "KDA kernel").

Times are medians of back-to-back runs on device (JAX: benchmarks.timing.time_ms, groups of calls of
about 100 ms between syncs; torch: triton.testing.do_bench, CUDA events around each call). Errors are
||x - ref|| / ||ref|| against the float32 XLA reference on the same bf16 inputs, taken as the worst over
o, dq, dk, dv, dg, dbeta (and the forward alone's o).
"""

import argparse
import datetime
import functools
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

from benchmarks.flops import kda_forward_flops_per_token
from benchmarks.timing import time_ms  # imports jax lazily: the fla child shares this file

SHAPES = ((2, 8192), (1, 32768), (1, 131072))
H, D, LB = 16, 128, -5.0
INTERPRET = False  # --smoke: tiny shapes through Pallas interpret mode, to test this script on a CPU
SHM = "/dev/shm/kda_bench"
SECTION = "## KDA kernel"
# fla 0.6.0 chunk_kda (safe gate, lb=-5) on this project's H200, measured 2026-12-02, used
# with --fla-design when a run cannot afford fla's first-call autotuning: {(B, T): (fwd ms, fwd+bwd ms)}.
FLA_DESIGN = {(2, 8192): (0.89, 4.53), (1, 32768): (2.09, 9.96)}


# ----------------------------------------------------------------------------- fla child process
def fla_child(shapes, reps_ms):
  """Times fla on every shape in one process (its autotuning runs once) and saves its outputs."""
  import numpy as np
  import torch
  import triton
  from fla.ops.kda import chunk_kda

  kw = dict(scale=D**-0.5, safe_gate=True, lower_bound=LB)
  for B, T in shapes:
    tag = f"{SHM}/{B}x{T}"
    load = lambda name, tag=tag: torch.from_numpy(np.load(f"{tag}_{name}.npy")).view(torch.bfloat16).cuda()
    xs = [load(n) for n in ("q", "k", "v", "g", "beta")]
    do = load("do")
    with torch.no_grad():
      fwd_ms = triton.testing.do_bench(lambda xs=xs: chunk_kda(*xs, **kw), warmup=reps_ms, rep=reps_ms,
                                       return_mode="median")
    leaves = [x.clone().requires_grad_(True) for x in xs]

    def fwd_bwd(leaves=leaves, do=do):
      o, _ = chunk_kda(*leaves, **kw)
      o.backward(do)
      return o

    both_ms = triton.testing.do_bench(fwd_bwd, warmup=reps_ms, rep=reps_ms, grad_to_none=leaves,
                                      return_mode="median")
    for x in leaves:
      x.grad = None
    o = fwd_bwd()
    for name, x in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), [o] + [x.grad for x in leaves], strict=True):
      np.save(f"{tag}_fla_{name}.npy", x.detach().contiguous().view(torch.int16).cpu().numpy())
    del xs, do, leaves, o
    torch.cuda.empty_cache()
    print(json.dumps(dict(B=B, T=T, fwd_ms=fwd_ms, fwd_bwd_ms=both_ms)), flush=True)


# ----------------------------------------------------------------------------- JAX side
def _jax():
  import jax
  import jax.numpy as jnp
  return jax, jnp


def make_inputs(B, T, seed=0, gate=None, heads=None):
  """q, k unit rows, v normal, g uniform in [-5, 0) (or all `gate`), beta in (0, 1), dO normal; bf16."""
  jax, jnp = _jax()
  ks = jax.random.split(jax.random.key(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  shape = (B, T, heads or H, D)
  q = unit(jax.random.normal(ks[0], shape))
  k = unit(jax.random.normal(ks[1], shape))
  v = jax.random.normal(ks[2], shape)
  g = (jax.random.uniform(ks[3], shape, minval=LB, maxval=0.0) if gate is None
       else jnp.full(shape, gate, jnp.float32))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], shape[:3]))
  do = jax.random.normal(ks[5], shape)
  return tuple(x.astype(jnp.bfloat16) for x in (q, k, v, g, beta, do))


def kda_fns(impl, config=None, chunk=32):
  """(forward, forward+backward) jitted functions of (q, k, v, g, beta[, dO])."""
  jax, _ = _jax()
  from pallas_kernels.kda import chunk_kda
  from pallas_kernels.kda.inputs import resets
  from pallas_kernels.kda.ops import chunk_kda_pallas

  if impl == "pallas" and config is not None:
    def run(q, k, v, g, beta):
      return chunk_kda_pallas(q, k, v, g, beta, D**-0.5, None, resets(None), chunk_size=chunk,
                              output_final_state=False, interpret=INTERPRET, config=config)[0]
  else:
    impl = "interpret" if INTERPRET and impl == "pallas" else impl

    def run(q, k, v, g, beta):
      return chunk_kda(q, k, v, g, beta, chunk_size=chunk, implementation=impl)[0]

  def fwd_bwd(q, k, v, g, beta, do):
    o, vjp = jax.vjp(run, q, k, v, g, beta)
    return (o,) + vjp(do)

  return jax.jit(run), jax.jit(fwd_bwd)


def rel_err(xs, refs):
  _, jnp = _jax()
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return max(float(jnp.linalg.norm(f32(x) - f32(r)) / jnp.linalg.norm(f32(r)))
             for x, r in zip(xs, refs, strict=True))


def reference(inputs):
  """float32 XLA reference (exact float32 products) of o and all gradients, on the bf16 inputs."""
  _, jnp = _jax()
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  return kda_fns("xla")[1](*f32)


def ceilings():
  """Measured copy bandwidth (bytes read + written per second) and bf16 matmul rate on this GPU."""
  from benchmarks.timing import copy_bandwidth, matmul_rate

  return copy_bandwidth(), matmul_rate()


def floor_ms(B, T, both: bool, bw, flops, C):
  """Physical floor: each input read once and each output written once, and the chunked form's FLOPs
  (scores, solve, state products; backward counted as twice the forward)."""
  K = V = D
  n = B * T * H
  bytes_ = 2 * (4 * n * D + n) + 2 * n * V                       # q k v g beta in, o out
  if both:
    bytes_ += 2 * (n * V) + 2 * (4 * n * D + n)                  # dO in; dq dk dv dg dbeta out
  f = n / H * kda_forward_flops_per_token(H, K, V, C) * (3 if both else 1)
  return max(bytes_ / bw, f / flops) * 1e3


def write_inputs(B, T, inputs):
  import numpy as np
  os.makedirs(SHM, exist_ok=True)
  for name, x in zip(("q", "k", "v", "g", "beta", "do"), inputs, strict=True):
    np.save(f"{SHM}/{B}x{T}_{name}.npy", np.asarray(x).view(np.int16))


def read_fla_outputs(B, T):
  import ml_dtypes
  import numpy as np
  return [np.load(f"{SHM}/{B}x{T}_fla_{n}.npy").view(ml_dtypes.bfloat16)
          for n in ("o", "dq", "dk", "dv", "dg", "dbeta")]


def fla_tune_dir(tune_cache: str, device: str) -> pathlib.Path:
  """The Triton cache folder of fla's child for this GPU model: one per model, because Triton keys its
  autotuning results by the compile target (sm_90 for both the H100 and the H200), not by the card."""
  model = "".join(c if c.isalnum() else "_" for c in device).strip("_") or "gpu"
  return pathlib.Path(tune_cache).absolute() / model  # absolute: Triton reads it from the child's env


def autotune_results(folder: pathlib.Path) -> int:
  """How many kernels' autotuning results (Triton's `cache_results` files) the folder holds."""
  return sum(1 for _ in folder.rglob("*.autotune.json")) if folder.is_dir() else 0


def run_fla(shapes, reps_ms, timeout_s, tune_dir: pathlib.Path | None = None):
  """{(B, T): fla timings}, from one child process (no JAX in it). A child that outlives timeout_s
  (its first call autotunes every kernel) is stopped, keeping the shapes it finished. With tune_dir,
  the child's Triton cache is there: fla's kernels autotune with Triton's `cache_results` (fla's
  FLA_CACHE_RESULTS, on by default), so results kept from an earlier call skip their autotuning."""
  arg = ",".join(f"{B}x{T}" for B, T in shapes)
  env = dict(os.environ)
  if tune_dir is not None:
    env.update(TRITON_CACHE_DIR=str(tune_dir), FLA_CACHE_RESULTS="1")
    print(f"fla child: Triton cache {tune_dir}, {autotune_results(tune_dir)} autotuning results in it",
          flush=True)
  try:
    out = subprocess.run([sys.executable, "-m", "benchmarks.kda", "--fla-child", arg,
                          "--fla-ms", str(reps_ms)],
                         capture_output=True, text=True, timeout=timeout_s, env=env,
                         cwd=pathlib.Path(__file__).resolve().parents[1])
    stdout, stderr, failed = out.stdout, out.stderr, out.returncode != 0
  except subprocess.TimeoutExpired as e:
    text = lambda x: x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
    stdout, stderr, failed = text(e.stdout), f"stopped after {timeout_s} s\n" + text(e.stderr), True
  res = {}
  for line in stdout.splitlines():
    if line.startswith("{"):
      r = json.loads(line)
      res[(r["B"], r["T"])] = r
  if failed or len(res) < len(shapes):
    print("fla child failed:", stdout[-2000:], stderr[-3000:], flush=True)
  return res


def pallas_config(args, merged: bool = False):
  """The op's Config with --scan-lowering applied, and for "pallas-merged" with merge_chunks (the
  forward's chunk pairs merged for its state pass); None (the op's defaults) without either."""
  if not args.scan_lowering and not merged:
    return None
  from pallas_kernels.kda.config import Config
  fwd, bwd = args.scan_lowering.split(",") if args.scan_lowering else ("", "")
  return Config(scan_fwd_lowering=fwd or None, scan_bwd_lowering=bwd or None, merge_chunks=merged)


def main_table(args):
  jax, jnp = _jax()
  device = jax.devices()[0].device_kind
  bw, flops = (4.3e12, 7.9e14) if INTERPRET else ceilings()
  print(f"device {device}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
  rows = []
  fns = {impl: kda_fns(impl.split("-")[0], config=pallas_config(args, merged=impl == "pallas-merged")
                       if impl.startswith("pallas") else None, chunk=args.chunk)
         for impl in args.impls.split(",")}
  fns.update({f"pallas:{text}": kda_fns("pallas", config=config_of(text), chunk=args.chunk)
              for text in args.table_configs})
  fla_all = {}
  if not args.no_fla:
    for B, T in SHAPES:
      write_inputs(B, T, make_inputs(B, T))
    t0 = time.perf_counter()
    tune_dir = fla_tune_dir(args.fla_tune_cache, device) if args.fla_tune_cache else None
    fla_all = run_fla(SHAPES, args.fla_ms, args.fla_timeout, tune_dir)
    kept = f", {autotune_results(tune_dir)} autotuning results kept" if tune_dir else ""
    print(f"fla child: {time.perf_counter() - t0:.0f} s{kept}", flush=True)
  for B, T in SHAPES:
    inputs = make_inputs(B, T)
    fla = fla_all.get((B, T))
    ref = None if args.no_ref or T > args.ref_max_t else reference(inputs)
    err = lambda out, ref=ref: float("nan") if ref is None else rel_err(out, ref)
    res = {}
    for impl, (fwd, both) in fns.items():
      if impl == "xla" and T > args.xla_max_t:
        continue
      out = both(*inputs)
      # The forward alone may take another path than the one under the gradient (merged chunk pairs,
      # a segmented state pass): its o is checked too.
      e = max(err(out), float("nan") if ref is None else rel_err((fwd(*inputs[:5]),), ref[:1]))
      res[impl] = (time_ms(fwd, *inputs[:5]), time_ms(both, *inputs), e)
      del out
    if fla is not None:
      fla_out = [jnp.asarray(x) for x in read_fla_outputs(B, T)]
      res["fla"] = (fla["fwd_ms"], fla["fwd_bwd_ms"], err(fla_out))
    elif args.fla_design and (B, T) in FLA_DESIGN:
      res["fla"] = (*FLA_DESIGN[(B, T)], float("nan"))
    ff, fb = floor_ms(B, T, False, bw, flops, args.chunk), floor_ms(B, T, True, bw, flops, args.chunk)
    for impl, (tf, tb, err) in res.items():
      ratio = (f"{tf / res['fla'][0]:.2f}", f"{tb / res['fla'][1]:.2f}") if "fla" in res else ("-", "-")
      name = {"pallas": "ours (pallas)", "pallas-merged": "ours (pallas, chunk pairs merged)",
              "xla": "ours (xla ref)",
              "fla": "fla 0.6.0" + (" (measured on an H200, 2026-12-02)" if fla is None else "")}.get(
                  impl, f"ours (pallas, {impl.partition(':')[2]})")
      rows.append((f"B={B} T={T}", name, f"{tf:.3f}", f"{tb:.3f}", *ratio, f"{tf / ff:.1f}",
                   f"{tb / fb:.1f}", "-" if err != err else f"{err:.1e}"))
      print(" | ".join(rows[-1]), flush=True)
    del inputs, ref
  finite = None if args.no_stress else stress_1m(fns["pallas"], args.stress_heads)
  header = ("shape", "impl", "fwd ms", "fwd+bwd ms", "fwd/fla", "f+b/fla", "fwd/floor", "f+b/floor",
            "rel err")
  table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                    + ["| " + " | ".join(r) + " |" for r in rows])
  print("\n" + table)
  print("\n" + stress_line(args.stress_heads, args.chunk, finite))
  if args.section_out:
    write_section(args.section_out, section_text(table, device, bw, flops, " ".join(sys.argv[1:]), args.chunk,
                                                 stress_line(args.stress_heads, args.chunk, finite)))


def stress_1m(fns, heads=None):
  """The forward alone (whose state pass may run in segments) and forward + backward at T=1M (B=1) with
  every gate at the bound; whether every output of each is finite. heads: fewer than H where the H-head
  problem does not fit (H=16 asked the H200 for 46-61 GiB of temporaries on top of its inputs and
  outputs)."""
  jax, _ = _jax()
  inputs = make_inputs(1, 256 if INTERPRET else 1 << 20, seed=3, gate=LB, heads=heads)
  forward_finite = _finite(jax.block_until_ready(fns[0](*inputs[:5])))
  print(f"T=1M forward alone done, finite: {forward_finite}", flush=True)
  outs = jax.block_until_ready(fns[1](*inputs))
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    print(f"T=1M fwd+bwd done; device memory peak {stats['peak_bytes_in_use'] / 2**30:.1f} GiB", flush=True)
  return forward_finite, all(_finite(x) for x in outs)


def stress_line(heads, chunk, finite):
  what = f"T=1M bf16, every gate at -5 (B=1 H={heads or H} D={D}, chunk {chunk})"
  if finite is None:
    return f"{what}: not run in this call (--no-stress; `--stress-only` runs it alone)"
  return f"{what}: forward alone finite: {finite[0]}; forward and backward finite: {finite[1]}"


def _finite(x, slab=1 << 16):
  """Whether every entry of x [B,T,...] is finite, by slabs of T: max |x| of each slab is NaN or Inf
  exactly when an entry is, and no temporary as large as x is made."""
  slab = min(slab, x.shape[1])
  starts = sorted({min(t, x.shape[1] - slab) for t in range(0, x.shape[1], slab)})
  return all(bool(_slab_is_finite(slab)(x, t)) for t in starts)


@functools.cache
def _slab_is_finite(slab: int):
  """One jitted check per slab size, so same-shaped outputs share its compilation."""
  jax, jnp = _jax()
  return jax.jit(lambda x, t: jnp.isfinite(jnp.max(jnp.abs(jax.lax.dynamic_slice_in_dim(x, t, slab, 1)))))


def section_text(table, device, bw, flops, argv, chunk, stress):
  date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  return (f"{SECTION}\n\nMeasured {date} on {device} with `python -m benchmarks.kda {argv}` "
          f"(H={H}, D=K=V={D}, bf16 inputs, our chunk {chunk}, one document per row, no initial "
          f"state). Ceilings measured in "
          f"the same run: copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s; floor = "
          f"max(bytes / copy, FLOPs / matmul). Rel err: worst of o and the five gradients against the "
          f"float32 XLA reference on the same bf16 inputs ('-': not computed in this run).\n\n{table}\n\n"
          f"{stress}.\n")


def write_section(path, body):
  """Replace (or append) the KDA section of the markdown file at `path`."""
  text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
  start = text.find(SECTION)
  if start < 0:
    text = text.rstrip("\n") + "\n\n" + body
  else:
    end = text.find("\n## ", start + len(SECTION))
    text = text[:start] + body.rstrip("\n") + ("\n\n" + text[end + 1:] if end >= 0 else "\n")
  open(path, "w").write(text)
  print(f"wrote {path}")


def sweep(args):
  """Each kernel alone at the first shape (the scans also at the last) under a few launch settings."""
  jax, jnp = _jax()
  from pallas_kernels.kda import backward, forward, scan
  from pallas_kernels.kda.config import Config
  from pallas_kernels.kda.lowering import Tuning
  from pallas_kernels.kda.tiles import precision_for
  prec = precision_for(jnp.bfloat16)
  bf = jnp.bfloat16
  kw = dict(interpret=INTERPRET)

  def report(name, fn, *a):
    t0 = time.perf_counter()
    try:
      jax.block_until_ready(fn(*a))
    except Exception as e:  # a setting the compiler rejects (e.g. shared memory) is a result too
      print(f"{name:58s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      return
    compile_s = time.perf_counter() - t0
    print(f"{name:58s} {time_ms(fn, *a):8.3f} ms   (first call {compile_s:5.1f} s)", flush=True)

  shapes = args.sweep_shapes or [(B, T, H) for B, T in SHAPES[::2]]
  for (B, T, Hs), C in itertools.product(shapes, args.sweep_chunks):
    first = (B, T, Hs) == shapes[0]
    at = f"B={B} T={T} H={Hs} C={C}"
    q, k, v, g, beta, do = make_inputs(B, T, heads=Hs)
    g = g.astype(args.sweep_gates)
    doc = jnp.zeros((B, T), jnp.int32)
    if first or args.sweep_configs:
      for text, cfg in [("default config", Config())] + [(t, config_of(t)) for t in args.sweep_configs]:
        op_fwd, op_fb = kda_fns("pallas", cfg, chunk=C)
        report(f"{at} whole op forward ({text})", op_fwd, q, k, v, g, beta)
        report(f"{at} whole op forward + backward ({text})", op_fb, q, k, v, g, beta, do)
    prep = lambda block, tuning, keep_solve=False, C=C: jax.jit(functools.partial(
        forward.prep_forward, chunk=C, block=min(block, D), scale=D**-0.5, prec=prec, store_dtype=bf,
        tuning=tuning, keep_solve=keep_solve, **kw))
    W, U, qg, kd, Aqk, sdec, A, Linv = prep(64, Tuning(4, 1), keep_solve=True)(q, k, v, g, beta, doc)
    S0 = jnp.zeros((B, Hs, D, D), jnp.float32)
    if first:
      for block, nw, *ns in args.sweep_prep:
        ns = ns[0] if ns else 1
        report(f"{at} prep_fwd block={block} warps={nw} stages={ns}",
               prep(block, Tuning(nw, ns)), q, k, v, g, beta, doc)
    for bv, nw, ns in args.sweep_scan:
      tuning, bv = Tuning(nw, ns), min(bv, D)
      fwd = jax.jit(lambda *a, bv=bv, tuning=tuning: scan.scan_forward(
          *a, out_dtype=bf, block_v=bv, big=prec.big, tuning=tuning, **kw)[:2])
      report(f"{at} scan_fwd bv={bv} warps={nw} stages={ns}", fwd, W, U, qg, kd, Aqk, sdec, S0)
      bwd = jax.jit(lambda *a, bv=bv, tuning=tuning: scan.scan_backward(
          *a, store_dtype=bf, block_v=bv, big=prec.big, tuning=tuning, **kw))
      report(f"{at} scan_bwd bv={bv} warps={nw} stages={ns}", bwd, do, Aqk, kd, W, qg, sdec, S0)
    if not first:
      continue
    fwd_keep = jax.jit(lambda *a: scan.scan_forward(*a, out_dtype=bf, block_v=32, big=prec.big,
                                                    states_dtype=bf, tuning=Tuning(4, 2), **kw))
    report(f"{at} scan_fwd keeping states bv=32", fwd_keep, W, U, qg, kd, Aqk, sdec, S0)
    _, _, states, Vp = fwd_keep(W, U, qg, kd, Aqk, sdec, S0)
    dVp, dSn, _ = scan.scan_backward(do, Aqk, kd, W, qg, sdec, S0, store_dtype=bf, block_v=32,
                                     big=prec.big, tuning=Tuning(4, 2), **kw)
    for block, nw in args.sweep_grads:
      sg = jax.jit(functools.partial(backward.state_grads, block=min(block, D), prec=prec, store_dtype=bf,
                                     tuning=Tuning(nw, 1), **kw))
      report(f"{at} state_grads block={block} warps={nw}", sg, states, dSn, do, dVp, Vp)
    dW, dqg, dkd, dAqk, dsdec = backward.state_grads(states, dSn, do, dVp, Vp, block=min(64, D), prec=prec,
                                                     store_dtype=bf, tuning=Tuning(4, 1), **kw)
    for block, nw, *ns in args.sweep_prep:
      ns = ns[0] if ns else 1
      pb = jax.jit(functools.partial(backward.prep_backward, chunk=C, block=min(block, D), scale=D**-0.5,
                                     prec=prec, tuning=Tuning(nw, ns), **kw))
      report(f"{at} prep_bwd block={block} warps={nw} stages={ns}", pb, q, k, v, g, beta, doc,
             A, Linv, dW, dVp, dqg, dkd, dAqk, dsdec)
    del states, dSn, dVp, Vp


def config_of(text: str):
  """A kda Config from 'field=value,field=value' (ints, true/false, or strings such as 'triton'); the
  launch parameters (Tuning fields) are not settable this way. Raises ValueError on a bad text."""
  import dataclasses

  from pallas_kernels.kda.config import Config

  names = {f.name for f in dataclasses.fields(Config) if "Tuning" not in str(f.type)}
  fields = {}
  for item in text.split(","):
    name, eq, value = item.partition("=")
    if not eq or name not in names:
      raise ValueError(f"{item!r} is not FIELD=VALUE with FIELD one of {sorted(names)}")
    lowered = value.lower()
    fields[name] = (int(value) if value.isdigit() else lowered == "true" if lowered in ("true", "false")
                    else value)
  return Config(**fields)


def main_check(args):
  """Pallas vs the float32 reference on a mid-size problem, bf16 and float32, with segments and state."""
  jax, jnp = _jax()
  from pallas_kernels.kda import chunk_kda
  B, T = (2, 100) if INTERPRET else (2, 1000)
  inputs = make_inputs(B, T, seed=7)
  seg = jnp.asarray((jnp.arange(T)[None] >= jnp.asarray([[T // 3], [T - 1]])).astype(jnp.int32))
  S0 = jax.random.normal(jax.random.key(2), (B, H, D, D), jnp.float32)
  for C, dtype in itertools.product(args.check_chunks, (jnp.bfloat16, jnp.float32)):
    xs = tuple(x.astype(dtype) for x in inputs)

    def f(impl, q, k, v, g, beta, S0, C=C):
      return chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, segment_ids=seg,
                       chunk_size=C, implementation=impl)

    def both(impl, *a):
      out, vjp = jax.vjp(functools.partial(f, impl), *a[:5], a[6])
      return out + vjp((a[5], jnp.ones_like(out[1])))

    ref = jax.jit(functools.partial(both, "xla"))(*(x.astype(jnp.float32) for x in xs), S0)
    got = jax.jit(functools.partial(both, "interpret" if INTERPRET else "pallas"))(*xs, S0)
    names = ("o", "S_T", "dq", "dk", "dv", "dg", "dbeta", "dS0")
    errs = [f"{n}={float(jnp.linalg.norm(a.astype(jnp.float32) - r) / jnp.linalg.norm(r)):.1e}"
            for n, a, r in zip(names, got, ref, strict=True)]
    print(f"check C={C} {jnp.dtype(dtype).name}: " + " ".join(errs), flush=True)


def main():
  global SHAPES, H, D, INTERPRET
  p = argparse.ArgumentParser()
  p.add_argument("--fla-child")
  p.add_argument("--sweep", action="store_true")
  p.add_argument("--check", action="store_true")
  p.add_argument("--check-chunks", type=int, nargs="+", default=[32, 64, 128], help="chunk sizes for --check")
  p.add_argument("--section-out", help="write the KDA section (table, command, date, device) into this "
                 "markdown file, replacing an older one (BENCHMARKS.md, or a file under $OUT)")
  p.add_argument("--fla-design", action="store_true",
                 help="without --fla runs: fla ratios from its times on an H200 (2026-12-02)")
  p.add_argument("--no-fla", action="store_true")
  p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU), no fla")
  p.add_argument("--fla-ms", type=int, default=200)
  p.add_argument("--fla-timeout", type=int, default=420, help="seconds for the fla child (autotuning too)")
  p.add_argument("--fla-tune-cache", metavar="DIR", help="keep fla's autotuning results in DIR/<GPU "
                 "model> (its child's Triton cache), so that a later call given them skips that autotuning")
  p.add_argument("--impls", default="pallas,xla", help="of pallas, pallas-merged (Config.merge_chunks: "
                 "the forward's chunk pairs merged for its state pass), xla")
  p.add_argument("--no-ref", action="store_true", help="skip the float32 reference (no errors)")
  p.add_argument("--ref-max-t", type=int, default=1 << 30, help="errors only up to this T")
  p.add_argument("--no-stress", action="store_true", help="skip the T=1M run")
  p.add_argument("--stress-only", action="store_true", help="only the T=1M run (ours, --chunk)")
  p.add_argument("--stress-heads", type=int, default=None, help="heads of the T=1M run (default H)")
  p.add_argument("--xla-max-t", type=int, default=1 << 30)
  p.add_argument("--shapes", type=lambda s: tuple(int(x) for x in s.split("x")), nargs="+",
                 help="BxT shapes of the table instead of " + " ".join(f"{b}x{t}" for b, t in SHAPES)
                 + " (fla's child times the shapes in turn after its autotuning: under a time limit, "
                 "leaving some out lets it reach the others)")
  pair = lambda s: tuple(int(x) for x in s.split(","))
  p.add_argument("--sweep-prep", type=pair, nargs="*", default=[(32, 2), (32, 4, 2), (32, 4), (64, 4)],
                 help="block,num_warps[,num_stages] for the prep kernels")
  p.add_argument("--sweep-scan", type=pair, nargs="*",
                 default=[(32, 4, 3), (16, 4, 3), (32, 4, 2), (16, 4, 2), (64, 4, 3)],
                 help="block_v,num_warps,num_stages triples for the scans")
  p.add_argument("--sweep-grads", type=pair, nargs="*", default=[(64, 4), (128, 8), (32, 4)])
  p.add_argument("--sweep-configs", nargs="*", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                 help="--sweep also times the whole op with these kda Configs (e.g. block_v_fwd=16 or "
                 "scan_fwd_lowering=triton), against the default one, at every --sweep-shapes shape")
  p.add_argument("--table-configs", nargs="*", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                 help="rows of ours (pallas) with these kda Configs too, as --sweep-configs")
  p.add_argument("--sweep-chunks", type=int, nargs="*", default=[32], help="chunk sizes for --sweep")
  p.add_argument("--sweep-shapes", type=lambda s: tuple(int(x) for x in s.split("x")), nargs="*",
                 help="BxTxH shapes for --sweep (default: the table's first and last, H=16); the first "
                 "also times the whole op, the prep and state-gradient kernels")
  p.add_argument("--sweep-gates", default="bfloat16", help="dtype of the gates in --sweep (the model's "
                 "KDA layers pass float32)")
  p.add_argument("--chunk", type=int, default=32, help="chunk size of ours in the table (fla's is its own)")
  p.add_argument("--scan-lowering", help="FWD,BWD: the state passes' lowerings in ours (pallas), each "
                 "'triton', 'mosaic' or empty for the op's choice, e.g. 'mosaic,triton'")
  args = p.parse_args()
  if args.scan_lowering and len(args.scan_lowering.split(",")) != 2:
    p.error("--scan-lowering takes FWD,BWD, e.g. 'mosaic,triton'")
  for option in ("sweep_configs", "table_configs"):
    for text in getattr(args, option):
      try:
        config_of(text)
      except ValueError as e:
        p.error(f"--{option.replace('_', '-')}: {e}")
  if not (args.sweep or args.check or args.stress_only or args.no_stress or args.fla_child) \
      and "pallas" not in args.impls.split(","):
    p.error("the T=1M run times ours (pallas): put pallas in --impls, or pass --no-stress")
  if args.fla_child:
    return fla_child([tuple(map(int, s.split("x"))) for s in args.fla_child.split(",")], args.fla_ms)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.shapes:
    if any(len(s) != 2 or min(s) < 1 for s in args.shapes):
      p.error(f"--shapes takes BxT with positive B and T, got {args.shapes}")
    SHAPES = tuple(args.shapes)
  if args.smoke:
    SHAPES, H, D, INTERPRET = SHAPES if args.shapes else ((1, 128), (1, 192), (1, 256)), 2, 32, True
    args.no_fla = True
  if args.check:
    return main_check(args)
  if args.sweep:
    return sweep(args)
  if args.stress_only:
    finite = stress_1m(kda_fns("pallas", chunk=args.chunk), args.stress_heads)
    print(stress_line(args.stress_heads, args.chunk, finite))
    return
  main_table(args)


if __name__ == "__main__":
  main()
