"""Causal attention over packed documents on one GPU: ours (pallas_kernels.attention) vs cuDNN with
a dense document mask (MLA's GPU path for packed rows up to 16K before these kernels) vs jax's own
Pallas flash kernel with segment ids.

    python -m benchmarks.attention --out BENCHMARKS.md    # GPU
    python -m benchmarks.attention --smoke                # CPU, interpret mode, tiny shapes; prints

Rows hold documents of geometric length (mean --mean-doc), as in benchmarks/step.py. Useful FLOPs
count only the (query, key) pairs inside documents: 2 (D + V) per pair forward, 2.5x that backward.
Errors: relative error of o, dq, dk, dv against the float32 XLA reference on the same bf16 inputs,
where that reference fits (T <= 8192).
"""

import argparse
import datetime
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import replace_section
from benchmarks.timing import time_ms
from pallas_kernels.attention import Blocks, document_attention, document_attention_reference

SECTION = "Document attention"
H, D = 8, 128  # experiments/h200.py's MLA


def segments(B, T, mean_doc, seed):
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    ends = np.minimum(np.cumsum(rng.geometric(1.0 / mean_doc, size=T)), T)
    seg[b] = np.searchsorted(ends, np.arange(T), side="right")
  return seg


def pair_count(seg):
  """(query, key) pairs inside documents, causal, summed over rows."""
  total = 0
  for row in seg:
    lengths = np.diff(np.flatnonzero(np.diff(np.r_[-1, row, -2])))
    total += int(np.sum(lengths * (lengths + 1) // 2))
  return total


def impls(smoke, T):
  scale = D ** -0.5
  ours = lambda q, k, v, s: document_attention(q, k, v, s, scale=scale,
                                               implementation="interpret" if smoke else "pallas")
  out = {"ours (pallas_kernels.attention)": ours}
  if smoke:
    return out
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as jax_flash
  out["jax Pallas mha (segment ids)"] = lambda q, k, v, s: jax_flash.mha(q, k, v, s, sm_scale=scale,
                                                                          causal=True)
  if T <= 16384:
    def cudnn(q, k, v, s):
      mask = s[:, None, :, None] == s[:, None, None, :]
      return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                          implementation="cudnn")
    out["cuDNN, dense document mask"] = cudnn
  return out


def fwd_bwd(f):
  def run(q, k, v, s, do):
    o, vjp = jax.vjp(lambda q, k, v: f(q, k, v, s), q, k, v)
    return (o, *vjp(do))
  return jax.jit(run)


def rel_errs(got, want):
  f = lambda x: np.asarray(x, np.float32)
  return [float(np.linalg.norm(f(a) - f(b)) / np.linalg.norm(f(b))) for a, b in zip(got, want, strict=True)]


def run(args):
  shapes = [(2, 256), (1, 1000)] if args.smoke else [tuple(map(int, s.split("x"))) for s in args.shapes]
  mean_doc = 64 if args.smoke else args.mean_doc
  lines = ["| B | T | implementation | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | time / ours "
           "(fwd, f+b) | rel err o / dq / dk / dv |", "|---|---|---|---|---|---|---|---|---|"]
  failures = []
  for B, T in shapes:
    seg = jnp.asarray(segments(B, T, mean_doc, seed=T))
    pairs = pair_count(np.asarray(seg))
    ks = jax.random.split(jax.random.key(T), 4)
    q, k, v, do = (jax.random.normal(key, (B, T, H, D), jnp.bfloat16) for key in ks)
    want = None
    if T <= 8192:
      ref = lambda q, k, v, s: document_attention_reference(q, k, v, s, scale=D ** -0.5)
      want = fwd_bwd(ref)(*(x.astype(jnp.float32) for x in (q, k, v)), seg, do.astype(jnp.float32))
    flops = 2 * (D + D) * pairs * H
    res = {}
    for name, f in impls(args.smoke, T).items():
      if T > args.others_max_t and not name.startswith("ours"):
        continue
      try:
        errs = "-"
        if want is not None:
          e = rel_errs(fwd_bwd(f)(q, k, v, seg, do), want)
          errs = " / ".join(f"{x:.1e}" for x in e)
          if name.startswith("ours") and max(e) > 1e-2:
            failures.append(f"{name} T={T}: {errs}")
        fwd = jax.jit(f)
        tf, tb = time_ms(fwd, q, k, v, seg), time_ms(fwd_bwd(f), q, k, v, seg, do)
      except Exception as e:  # noqa: BLE001 - a competitor that cannot run this shape is reported as such
        print(f"B={B} T={T} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        lines.append(f"| {B} | {T} | {name} | failed ({type(e).__name__}) | | | | | |")
        continue
      res[name] = (tf, tb)
      mine = next((t for n, t in res.items() if n.startswith("ours")), None)
      ratio = "-" if mine is None else f"{tf / mine[0]:.2f}, {tb / mine[1]:.2f}"
      rates = f"{flops / tf / 1e9:.0f} | {3.5 * flops / tb / 1e9:.0f}"  # ms -> TFLOP/s
      row = f"{tf:.3f} | {tb:.3f} | {rates} | {ratio} | {errs}"
      print(f"B={B} T={T} {name}: {row}", flush=True)
      lines.append(f"| {B} | {T} | {name} | {row} |")
    del want
  return lines, failures


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--mean-doc", type=int, default=2048)
  p.add_argument("--shapes", nargs="*", default=["4x8192", "1x131072", "1x1048576"], help="BxT")
  p.add_argument("--others-max-t", type=int, default=131072, help="competitors only up to this T")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  elif jax.devices()[0].platform != "gpu":
    sys.exit("benchmarks/attention.py needs a GPU; use --smoke on CPU")
  lines, failures = run(args)
  dev = jax.devices()[0]
  body = "\n".join([
      f"Command: `python -m benchmarks.attention {' '.join(sys.argv[1:])}`  ",
      f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device: {dev.device_kind}, "
      f"jax {jax.__version__}.", "",
      f"H={H}, D=V={D}, bf16, causal attention within documents of geometric length (mean "
      f"{args.mean_doc if not args.smoke else 64}). TFLOP/s count only in-document pairs; 'time / ours' "
      f"above 1 means ours is faster. Default blocks: {Blocks()}.", "", *lines])
  print("\n" + body)
  if args.out:
    replace_section(args.out, SECTION, body)
    print(f"wrote the '{SECTION}' section of {args.out}")
  if failures:
    sys.exit(f"our kernel is off the float32 reference: {failures}")


if __name__ == "__main__":
  main()
