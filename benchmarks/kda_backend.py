"""Pallas lowering for the KDA kernels, measured on the state scans: forward and backward on the Triton
lowering (pallas_kernels.kda.scan.scan_forward / scan_backward, the op's launch parameters) against
their Mosaic GPU ports (pallas_kernels.kda.mosaic), same inputs, same V blocks, one GPU, one
process.

    python -m benchmarks.kda_backend --out $OUT/kda_backend.md  # GPU: the table, as a ### section
    python -m benchmarks.kda_backend --smoke                    # CPU: tiny shapes, interpret mode, no times

Inputs come from the op's forward prep kernel on random q, k, v, g (gates in [-5, 0)) and beta drawn as
benchmarks/kda.py draws them (B=2 T=8192 H=16 K=V=128 bf16), plus a random initial state, so the scan
sees the value ranges it sees in the op; the backward scan takes those A_qk, kd, W, qg, sdec with a random
bf16 dO and a random float32 cotangent of the final state. Times: medians of back-to-back calls
(benchmarks/timing.time_ms). Errors: ||x - y|| / ||y||, the worse over o and the final state (forward) or
over dV', the per-chunk dS and dS0 (backward), against the Triton scan at the same chunk and V block, and
against a float32 XLA recurrence. A setting that fails (compilation, shared memory, a run-time error)
prints its error and the run goes on; one that hangs past --row-timeout ends the run with a traceback,
after the rows before it were printed. Rows run Triton before Mosaic and forward before backward, so the
newest kernels (the Mosaic backward scan, last) cannot take the others down with them.
"""

import faulthandler
import functools

from benchmarks.report import kernel_benchmark_args, provenance, replace_section
from benchmarks.timing import time_ms

TITLE = "Pallas backend: Triton vs Mosaic GPU"  # a ### section, inside "KDA kernel"
SHAPE = dict(B=2, T=8192, H=16, D=128)
SMOKE_SHAPE = dict(B=1, T=128, H=1, D=64)  # the port needs K >= 64; 2-4 chunks per row


def add_arguments(p):
  p.add_argument("--chunks", type=int, nargs="+", default=[64, 32])
  p.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64])
  p.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="chunk slots of the Mosaic port")
  p.add_argument("--row-timeout", type=int, default=120, help="seconds before a hung row ends the run")


def make_scan_inputs(B, T, H, D, C, interpret):
  """W, U, qg, kd, Aqk, sdec by the op's forward prep kernel (Triton) on random inputs, and S0."""
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.config import Config
  from pallas_kernels.kda.forward import prep_forward
  from pallas_kernels.kda.tiles import precision_for

  # As benchmarks/kda.py draws them: q, k unit rows, v normal, g uniform in [-5, 0), beta in (0, 1).
  ks = jax.random.split(jax.random.key(0), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (unit(jax.random.normal(key, (B, T, H, D))).astype(jnp.bfloat16) for key in ks[:2])
  v = jax.random.normal(ks[2], (B, T, H, D)).astype(jnp.bfloat16)
  g = jax.random.uniform(ks[3], (B, T, H, D), minval=-5.0, maxval=0.0).astype(jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(jnp.bfloat16)
  cfg = Config().for_chunk(C)
  prep = jax.jit(functools.partial(
      prep_forward, chunk=C, block=min(cfg.block, D), scale=D**-0.5, prec=precision_for(jnp.bfloat16),
      store_dtype=jnp.bfloat16, interpret=interpret, tuning=cfg.prep_fwd))
  scan_in = prep(q, k, v, g, beta, jnp.zeros((B, T), jnp.int32))[:6]
  S0 = jax.random.normal(jax.random.key(9), (B, H, D, D), jnp.float32)
  return (*scan_in, S0)


def reference(W, U, qg, kd, Aqk, sdec, S0):
  """o [B,T,H,V] and the final state of the recurrence in float32 (exact float32 products), by XLA."""
  import jax
  import jax.numpy as jnp

  B, H, T, K = W.shape
  C = Aqk.shape[-1]
  N = T // C
  mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  chunks = lambda x: jnp.moveaxis(x.astype(jnp.float32).reshape(B, H, N, C, -1), 2, 0)

  def step(S, xs):
    W, U, qg, kd, Aqk, sdec = xs
    Vp = U - mm(W, S)
    return sdec[..., None] * S + mm(jnp.swapaxes(kd, -1, -2), Vp), mm(qg, S) + mm(Aqk, Vp)

  sdec_N = jnp.moveaxis(sdec.astype(jnp.float32), 2, 0)
  S, o = jax.lax.scan(step, S0.astype(jnp.float32), (*map(chunks, (W, U, qg, kd, Aqk)), sdec_N))
  return jnp.moveaxis(o, 0, 2).reshape(B, H, T, -1).swapaxes(1, 2), S


def make_backward_inputs(scan_inputs):
  """(dO, Aqk, kd, W, qg, sdec, dSfin) for the backward scan: the forward's operands, a random bf16 dO
  [B,T,H,V] and a random float32 cotangent of the final state."""
  import jax
  import jax.numpy as jnp

  W, U, qg, kd, Aqk, sdec, S0 = scan_inputs
  B, H, T, _ = W.shape
  dO = jax.random.normal(jax.random.key(10), (B, T, H, U.shape[-1])).astype(jnp.bfloat16)
  dSfin = jax.random.normal(jax.random.key(11), S0.shape, jnp.float32)
  return dO, Aqk, kd, W, qg, sdec, dSfin


def reference_backward(dO, Aqk, kd, W, qg, sdec, dSfin):
  """dV' [B,H,T,V], the cotangent of the state leaving each chunk [B,H,N,K,V] and dS0 of the backward
  recurrence in float32 (exact float32 products), by XLA."""
  import jax
  import jax.numpy as jnp

  B, H, T, K = W.shape
  C = Aqk.shape[-1]
  N = T // C
  mm = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  tr = lambda x: jnp.swapaxes(x, -1, -2)
  chunks = lambda x: jnp.moveaxis(x.astype(jnp.float32).reshape(B, H, N, C, -1), 2, 0)

  def step(dS, xs):
    dO, Aqk, kd, W, qg, sdec = xs
    dVp = mm(tr(Aqk), dO) + mm(kd, dS)
    return sdec[..., None] * dS + mm(tr(qg), dO) - mm(tr(W), dVp), (dVp, dS)

  xs = (*map(chunks, (jnp.swapaxes(dO, 1, 2), Aqk, kd, W, qg)), jnp.moveaxis(sdec.astype(jnp.float32), 2, 0))
  dS0, (dVp, dSn) = jax.lax.scan(step, dSfin.astype(jnp.float32), xs, reverse=True)
  return jnp.moveaxis(dVp, 0, 2).reshape(B, H, T, -1), jnp.moveaxis(dSn, 0, 2), dS0


@functools.cache
def _rel_err():
  import jax
  import jax.numpy as jnp

  f32 = lambda x: x.astype(jnp.float32)
  return jax.jit(lambda a, b: jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))


def rel_err(outs, refs) -> float:
  """The worst ||a - b|| / ||b|| over the outputs (o, final state; or dV', per-chunk dS, dS0)."""
  return max(float(_rel_err()(a, b)) for a, b in zip(outs, refs, strict=True))


def short(e: Exception) -> str:
  """An error on one line: its type and the head and tail of its message (Mosaic's can be pages long)."""
  msg = " ".join(str(e).split())
  msg = msg if len(msg) <= 700 else msg[:300] + " ... " + msg[-400:]
  return f"{type(e).__name__}: {msg}"


CAPTION = ("The state scans alone (W, U, qg, kd, A_qk, sdec from the forward prep kernel; B={B} T={T} "
           "H={H} K=V={D} bf16; forward: a random initial state; backward: random bf16 dO and float32 "
           "final-state cotangent). Triton: scan.scan_forward / scan_backward with the op's launch "
           "parameters for the chunk (Config.for_chunk). Mosaic GPU: pallas_kernels/kda/mosaic/scan_*.py "
           "(wgmma, a TMA ring of chunk slots; one warpgroup per program). ms: median of back-to-back "
           "calls. Errors: ||x - y|| / ||y||, the worse of o and the final state (forward), the worst of "
           "dV', the per-chunk dS and dS0 (backward), against the Triton scan at the same chunk and V "
           "block and against a float32 XLA recurrence.")
HEADER = ("pass", "backend", "chunk", "block_v", "launch", "ms", "Mosaic/Triton", "err vs Triton",
          "err vs f32")


def triton_scan(block_v, tuning, interpret):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.scan import scan_forward

  return jax.jit(lambda *a: scan_forward(*a, out_dtype=jnp.bfloat16, block_v=block_v, big="bf16",
                                         interpret=interpret, tuning=tuning)[:2])


def mosaic_scan(block_v, stages, interpret):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.mosaic.scan_forward import scan_forward_mosaic

  return jax.jit(lambda *a: scan_forward_mosaic(*a, out_dtype=jnp.bfloat16, block_v=block_v, stages=stages,
                                                interpret=interpret)[:2])


def triton_scan_backward(block_v, tuning, interpret):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.scan import scan_backward

  return jax.jit(lambda *a: scan_backward(*a, store_dtype=jnp.bfloat16, block_v=block_v, big="bf16",
                                          interpret=interpret, tuning=tuning))


def mosaic_scan_backward(block_v, stages, interpret):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.mosaic.scan_backward import scan_backward_mosaic

  return jax.jit(lambda *a: scan_backward_mosaic(*a, store_dtype=jnp.bfloat16, block_v=block_v,
                                                 stages=stages, interpret=interpret))


def main():
  args = kernel_benchmark_args(__doc__.splitlines()[0], add_arguments)
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.config import Config
  from pallas_kernels.kda.mosaic.scan_backward import smem_bytes_backward
  from pallas_kernels.kda.mosaic.scan_forward import smem_bytes

  smoke = args.smoke
  B, T, H, D = (SMOKE_SHAPE if smoke else SHAPE).values()
  device = jax.devices()[0].device_kind
  default_bv = Config().block_v(None, B, H, D)
  block_vs = [bv for bv in args.block_v if bv <= D]
  print(f"device {device}; B={B} T={T} H={H} K=V={D} bf16; the op's V block {default_bv}", flush=True)
  fmt = lambda x: "-" if x is None else f"{x:.1e}"
  rows = []

  def run_row(pass_, backend, C, bv, launch, fn, inputs, ref, base=None):
    """Runs and times one setting and prints its row; returns (outputs, ms), or None where it failed."""
    faulthandler.dump_traceback_later(args.row_timeout, exit=True)
    try:
      out = jax.block_until_ready(fn(*inputs))
      ms = None if smoke else time_ms(fn, *inputs)  # interpret mode: nothing to time
      ratio = "-" if ms is None or base is None or base[1] is None else f"{ms / base[1]:.2f}"
      errs = fmt(None if base is None else rel_err(out, base[0])), fmt(rel_err(out, ref))
      result = out, ms
    except Exception as e:  # noqa: BLE001  (a failing setting is a result; the others still run)
      print(f"  {pass_} {backend} chunk {C} block_v {bv} ({launch}) failed: {short(e)}", flush=True)
      ms, ratio, errs, result = None, "-", ("-", "-"), None
    finally:
      faulthandler.cancel_dump_traceback_later()
    rows.append((pass_, backend, str(C), f"{bv}{' (op default)' if bv == default_bv else ''}", launch,
                 "-" if ms is None else f"{ms:.3f}", ratio, *errs))
    print("| " + " | ".join(rows[-1]) + " |", flush=True)
    return result

  # Every Triton row first: a Mosaic kernel that faults the GPU cannot take the baseline with it.
  problems = {C: make_scan_inputs(B, T, H, D, C, interpret=smoke) for C in args.chunks}
  problems_bwd = {C: make_backward_inputs(inputs) for C, inputs in problems.items()}
  refs = {C: jax.jit(reference)(*inputs) for C, inputs in problems.items()}
  refs_bwd = {C: jax.jit(reference_backward)(*inputs) for C, inputs in problems_bwd.items()}
  # Per pass: inputs and float32 references by chunk, the Triton and Mosaic scans, the Config field of the
  # Triton launch parameters and the Mosaic port's shared memory.
  passes = (("forward", problems, refs, triton_scan, mosaic_scan, "scan_fwd",
             lambda C, bv, stages: smem_bytes(D, C, bv, stages, jnp.bfloat16)),
            ("backward", problems_bwd, refs_bwd, triton_scan_backward, mosaic_scan_backward, "scan_bwd",
             lambda C, bv, stages: smem_bytes_backward(D, C, bv, stages)))
  triton = {}
  for pass_, inputs, ref, triton_fn, _, tuning_name, _ in passes:
    for C in args.chunks:
      tuning = getattr(Config().for_chunk(C), tuning_name)
      for bv in block_vs:
        launch = f"{tuning.num_warps} warps, {tuning.num_stages} stages"
        triton[pass_, C, bv] = run_row(pass_, "Triton", C, bv, launch, triton_fn(bv, tuning, smoke),
                                       inputs[C], ref[C])
  for pass_, inputs, ref, _, mosaic_fn, _, smem in passes:
    for C in args.chunks:
      for bv in block_vs:
        for stages in args.stages:
          launch = f"{stages} slots, {smem(C, bv, stages) / 1024:.0f} KiB smem"
          run_row(pass_, "Mosaic GPU", C, bv, launch, mosaic_fn(bv, stages, smoke), inputs[C], ref[C],
                  base=triton[pass_, C, bv])

  lines = [*provenance(device), CAPTION.format(B=B, T=T, H=H, D=D), "",
           "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER),
           *("| " + " | ".join(r) + " |" for r in rows)]
  print("\n" + "\n".join(lines))
  if args.out:
    replace_section(args.out, TITLE, "\n".join(lines), level=3)
    print(f"wrote the '{TITLE}' section of {args.out}")


if __name__ == "__main__":
  main()
