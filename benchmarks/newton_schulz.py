"""Muon's Newton-Schulz on the step's own matrices: the einsum form ("xla") against the symmetric
kernels of pallas_kernels/newton_schulz ("pallas"), in the same call.

  python -m benchmarks.newton_schulz --config experiments/h200.py --out BENCHMARKS.md
  python -m benchmarks.newton_schulz --sweep 128,64,4,3 128,64,8,3 64,64,4,3    # also these blocks
  python -m benchmarks.newton_schulz --smoke                                     # tiny, on the CPU

Times: medians of back-to-back calls of one jitted function. First the whole Muon update
(`scale_by_muon`) over the config's parameters, as the train step runs it (momentum, stacking, scaling
included), with its errors ||o - o_f32|| / ||o_f32|| against the same update with the iteration in float32
(XLA at precision "highest": exact float32 products). Then per group (the parameters Muon stacks and iterates
together, `moejax.training.muon.like_matrix_groups`): `newton_schulz` on random bf16 matrices of the group's
shape. The section is rewritten after each part, so a run cut off by a time limit keeps what it measured.
"""


from benchmarks.report import (
  kernel_benchmark_args,
  provenance,
  publish,
  relative_error,
  replace_section,
)
from benchmarks.timing import time_ms

SECTION = "Muon Newton-Schulz"


def add_arguments(p):
  p.add_argument("--config", default="experiments/h200.py")
  p.add_argument("--sweep", nargs="*", default=[], metavar="ROWS,DEPTH,WARPS,STAGES",
                 help="also time the kernels at these blocks, on the largest group")


def muon_side(config):
  """(params of the Muon side, MaskedNode elsewhere; their dimension numbers; their group keys), the
  params random float32 of the config's shapes."""
  import jax
  import jax.numpy as jnp
  import optax

  from benchmarks.step_setup import abstract_state
  from moejax.model import build_model
  from moejax.training.optimizers import muon_dimension_numbers

  shapes, _, axes = abstract_state(build_model(config), config)
  dims = muon_dimension_numbers(axes)
  leaves, treedef = jax.tree.flatten(shapes.params)
  dim_leaves = treedef.flatten_up_to(dims)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  params = [optax.MaskedNode() if d is None else jax.random.normal(k, s.shape, jnp.float32) * 0.02
            for s, d, k in zip(leaves, dim_leaves, keys, strict=True)]
  return jax.tree.unflatten(treedef, params), dims, axes


def groups(params, dims, axes) -> list[tuple[int, int, int]]:
  """(matrices, m, n) with m <= n of each group that orthogonalise_many iterates together."""
  import jax
  import optax

  from moejax.training.muon import like_matrix_groups, matrix_sizes

  is_masked = lambda x: isinstance(x, optax.MaskedNode)
  leaves, treedef = jax.tree.flatten(params, is_leaf=is_masked)
  live = [(x, d, key) for x, d, key in zip(leaves, treedef.flatten_up_to(dims), treedef.flatten_up_to(axes),
                                            strict=True) if not is_masked(x)]
  if not live:
    return []
  xs, ds, keys = zip(*live, strict=True)
  found = []
  for idx in like_matrix_groups(xs, ds, keys).values():
    count, fan_in, fan_out = matrix_sizes(xs[idx[0]], ds[idx[0]])
    found.append((len(idx) * count, min(fan_in, fan_out), max(fan_in, fan_out)))
  return found


def main():
  args = kernel_benchmark_args(__doc__.split("\n\n")[0], add_arguments)
  import jax
  import jax.numpy as jnp

  from benchmarks.step_setup import load_config
  from moejax.training.muon import NS_COEFFS, newton_schulz, scale_by_muon
  from pallas_kernels.kda.lowering import Tuning
  from pallas_kernels.newton_schulz import GRAM_BLOCKS, POLY_BLOCKS, Blocks, gram_poly

  ours = "interpret" if args.smoke else "pallas"
  # A smoke run checks that the script works end to end: one untimed and one timed call of each.
  timed = (lambda fn, *a: time_ms(fn, *a, calls=1, repeats=1)) if args.smoke else time_ms
  config = load_config(args.config, [], smoke=args.smoke)
  params, dims, axes = muon_side(config)

  describe = lambda b: (f"{b.rows}x{b.rows} output tiles, depth {b.depth}, {b.tuning.num_warps} warps, "
                        f"{b.tuning.num_stages} stages")
  lines = [*provenance(jax.devices()[0].device_kind),
           f"`{args.config}`'s Muon matrices, bf16 iteration (5 quintic steps); ours at the default blocks: "
           f"X X^T {describe(GRAM_BLOCKS)}; P {describe(POLY_BLOCKS)}."]

  def save(rest: str):
    """The section as far as it got, so that a run cut off by a time limit keeps its figures."""
    if not args.smoke and args.out:
      replace_section(args.out, SECTION, "\n".join(lines + ["", rest]))

  # The whole update first: its errors against float32 decide whether ours may be used at all.
  grads = jax.tree.map(lambda p: p * 0.5 + 0.01, params)
  updates, times = {}, {}
  for name, impl, dtype in (("float32 reference", "xla", jnp.float32), ("xla", "xla", jnp.bfloat16),
                            ("ours", ours, jnp.bfloat16)):
    opt = scale_by_muon(dims, beta=config.optim.muon_beta, consistent_rms=config.optim.muon_consistent_rms,
                        ns_dtype=dtype, group_keys=axes, ns_implementation=impl)
    state = opt.init(params)
    step = jax.jit(lambda g, s, opt=opt: opt.update(g, s)[0])
    if name == "float32 reference":  # exact float32 products (the GPU's default for float32 is TF32)
      with jax.default_matmul_precision("highest"):
        updates[name] = step(grads, state)
      continue
    updates[name] = step(grads, state)
    times[name] = timed(step, grads, state)
  flat = lambda u: [x for x in jax.tree.leaves(u) if hasattr(x, "shape")]
  err = {name: relative_error(jnp.concatenate([x.ravel() for x in flat(updates[name])]),
                              jnp.concatenate([x.ravel() for x in flat(updates["float32 reference"])]))
         for name in times}
  del updates
  lines += ["", "The whole Muon update over the config's parameters:", "",
            "| implementation | ms | rel err vs float32 |", "|---|---|---|",
            *(f"| {name} | {times[name]:.3f} | {err[name]:.1e} |" for name in times), "",
            f"xla / ours: {times['xla'] / times['ours']:.2f}x.", "",
            "Per group (`newton_schulz` on random bf16 matrices of the group's shape; the last column: "
            "ours with P at X X^T's blocks):", "",
            "| matrices (batch x m x n) | xla ms | ours ms | xla / ours | ours, P at X X^T's blocks ms |",
            "|---|---|---|---|---|"]
  print("\n".join(lines), flush=True)
  save("(the run ended before the first group)")

  rng = jax.random.key(1)
  sweep = []
  largest_first = sorted(groups(params, dims, axes), key=lambda g: -g[0] * g[1] * g[1] * g[2])

  def sweep_table() -> list[str]:
    if not sweep:
      return []
    b, m, n = largest_first[0]
    return ["", f"Blocks on the largest group ({b} x {m} x {n}), one call of each kernel, ms:", "",
            "| rows, depth, warps, stages | X X^T | P |", "|---|---|---|", *sweep]

  # One jitted function of each kind for all groups: groups of the same shape reuse its compilation.
  fns = {impl: jax.jit(lambda x, impl=impl: newton_schulz(x, implementation=impl)) for impl in ("xla", ours)}
  gram_p = jax.jit(lambda x: newton_schulz(x, implementation=ours, poly_blocks=GRAM_BLOCKS))
  totals = [0.0, 0.0, 0.0]
  for rank, (b, m, n) in enumerate(largest_first):
    x = jax.random.normal(rng, (b, m, n), jnp.bfloat16)
    t = {impl: timed(fn, x) for impl, fn in fns.items()}
    # Where both blocks shrink to the same ones on this group's m x m S, P at X X^T's blocks is the
    # same program as ours: time it again rather than trace and compile it twice.
    same = POLY_BLOCKS.fit(m, m) == GRAM_BLOCKS.fit(m, m)
    t_gram_p = timed(fns[ours] if same else gram_p, x)
    lines.append(f"| {b} x {m} x {n} | {t['xla']:.3f} | {t[ours]:.3f} | {t['xla'] / t[ours]:.2f} "
                 f"| {t_gram_p:.3f} |")
    totals = [sum(v) for v in zip(totals, (t["xla"], t[ours], t_gram_p), strict=True)]
    print(lines[-1], flush=True)
    save("\n".join([f"(the run ended after {rank + 1} of {len(largest_first)} groups)", *sweep_table()]))
    for text in args.sweep if rank == 0 else ():
      rows, depth, warps, stages = (int(v) for v in text.split(","))
      blocks = Blocks(rows=rows, depth=depth, tuning=Tuning(warps, stages))
      ran = blocks.fit(m, n, jnp.dtype(jnp.bfloat16).itemsize)
      if (ran.rows, ran.depth) != (rows, depth):  # the kernel shrinks what the matrices or SMEM can't take
        text += f" (runs as {ran.rows},{ran.depth},{warps},{stages})"
      s = jax.random.normal(rng, (b, m, m), jnp.bfloat16)
      s = (s + jnp.swapaxes(s, 1, 2)).astype(jnp.bfloat16)
      kernels = (jax.jit(lambda x, blocks=blocks: gram_poly(x, implementation=ours, blocks=blocks)),
                 jax.jit(lambda s, blocks=blocks: gram_poly(s, *NS_COEFFS[::-1], implementation=ours,
                                                            blocks=blocks)))
      cells = []
      for fn, arg in zip(kernels, (x, s), strict=True):
        try:
          cells.append(f"{timed(fn, arg):.3f}")
        except jax.errors.JaxRuntimeError as e:  # e.g. more shared memory than the card has
          print(f"  sweep {text}: failed: {str(e).splitlines()[0][:200]}", flush=True)
          cells.append(f"failed ({type(e).__name__})")
      sweep.append(f"| {text} | {cells[0]} | {cells[1]} |")
      print(f"  sweep {text}: X X^T {cells[0]} ms, P {cells[1]} ms", flush=True)
      save("\n".join(["(the run ended in the sweep, after the first group)", *sweep_table()]))
  lines.append(f"| sum | {totals[0]:.3f} | {totals[1]:.3f} | {totals[0] / totals[1]:.2f} | {totals[2]:.3f} |")
  lines += sweep_table()
  publish(None if args.smoke else args.out, SECTION, lines)


if __name__ == "__main__":
  main()
