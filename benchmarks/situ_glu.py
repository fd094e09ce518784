"""SiTU-GLU's element-wise pass: moejax's form against the tanh/sigmoid formula and SwiGLU.

    python -m benchmarks.situ_glu --out BENCHMARKS.md     # GPU: times, checks, writes the section
    python -m benchmarks.situ_glu --smoke                 # CPU: tiny shapes, prints

At the h200.py step's routed-expert shape: 262144 rows (32768 tokens x top 8) of 768 hidden units, bf16
gate and up in, bf16 h out. "formula" is h = b1 tanh(g/b1) sigmoid(g) b2 tanh(u/b2) written with
jnp.tanh and jax.nn.sigmoid (moejax's forward pass until 2026-12-04), differentiated by autodiff; SwiGLU
is silu(g) u, the activation SiTU-GLU bounds. Bytes: forward reads gate and up and writes h (6 per
element); the backward pass reads gate, up and dh and writes two gradients (10 more). Errors are relative
(norm) against the formula in float64 on the same bf16 inputs.
"""


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import fwd_bwd_table, kernel_benchmark_args, provenance, publish, relative_error
from benchmarks.timing import copy_floor_note, time_ms
from moejax.layers.ffn import situ_glu

SECTION = "SiTU-GLU element-wise pass"
B1, B2 = 4.0, 25.0


def formula(g, u):
  g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
  return (B1 * jnp.tanh(g32 / B1) * jax.nn.sigmoid(g32) * (B2 * jnp.tanh(u32 / B2))).astype(g.dtype)


def swiglu(g, u):
  return (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)


def ours(g, u):
  return situ_glu(g, u, B1, B2)


def fwd_bwd(f):
  def run(g, u, dh):
    h, vjp = jax.vjp(f, g, u)
    return (h, *vjp(dh))
  return jax.jit(run)


def reference(g, u, dh):
  """(h, dg, du) of the formula in float64 (NumPy, closed-form derivatives)."""
  g, u, dh = (np.asarray(x, np.float64) for x in (g, u, dh))
  tg, tu = np.tanh(g / B1), np.tanh(u / B2)
  s = 0.5 * (1.0 + np.tanh(0.5 * g))  # sigmoid without exp's overflow
  da = (1.0 - tg * tg) * s + B1 * tg * s * (1.0 - s)
  return B1 * tg * s * B2 * tu, dh * B2 * tu * da, dh * B1 * tg * s * (1.0 - tu * tu)


def main():
  args = kernel_benchmark_args(__doc__.splitlines()[0])
  rows_, hidden = (512, 96) if args.smoke else (262144, 768)
  ks = jax.random.split(jax.random.key(0), 3)
  g, u, dh = (jax.random.normal(k, (rows_, hidden), jnp.float32).astype(jnp.bfloat16) for k in ks)
  g = g * 3  # gate pre-activations spread over the tanh's and sigmoid's curved parts
  want = reference(g, u, dh)
  rows, times = [], {}
  for name, f in (("moejax (exponential form, hand-written backward)", ours),
                  ("formula (jnp.tanh, jax.nn.sigmoid; autodiff)", formula), ("SwiGLU (autodiff)", swiglu)):
    tf, tb = time_ms(jax.jit(f), g, u), time_ms(fwd_bwd(f), g, u, dh)
    errs = "-" if f is swiglu else " / ".join(f"{relative_error(a, b):.1e}" for a, b in
                                              zip(fwd_bwd(f)(g, u, dh), want, strict=True))
    times[f.__name__] = (tf, tb)
    rows.append((name, tf, tb, errs))
    print(f"{name}: fwd {tf:.3f} ms, fwd+bwd {tb:.3f} ms, rel err h / dg / du {errs}", flush=True)
  n = rows_ * hidden
  shape_note = " (the routed experts' hidden activations in `experiments/h200.py`'s step)"
  floor = "" if args.smoke else copy_floor_note(6 * n, 16 * n)
  lines = [*provenance(jax.devices()[0].device_kind),
           f"{rows_} x {hidden}{'' if args.smoke else shape_note}, "
           f"b1={B1:g}, b2={B2:g}, bf16 in and out, gate ~ N(0, 9), up and dh ~ N(0, 1).{floor}", "",
           *fwd_bwd_table(rows, "rel err h / dg / du vs float64 formula")]
  r = [times["formula"][i] / times["ours"][i] for i in range(2)]
  lines += ["", f"Formula time / moejax's: forward {r[0]:.2f}x, forward + backward {r[1]:.2f}x."]
  publish(args.out, SECTION, lines)


if __name__ == "__main__":
  main()
