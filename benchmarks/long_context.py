"""The long-context claim, measured: associative recall past the trained length against ablations, and
a million-token prefill on one GPU.

python -m benchmarks.long_context recall [--steps 1500] [--lengths 256,1024,4096,16384] [--jobs 5]
                                         [--out BENCHMARKS.md]
python -m benchmarks.long_context prefill [--config experiments/h200.py] [--out BENCHMARKS.md]
python -m benchmarks.long_context {recall,prefill} --smoke     (tiny and short, on the CPU; writes nothing)

recall: experiments/mqar_tiny.py trained at 256 tokens (moejax.train's loop, one workdir per variant
under --workdir, resumed where a run is already there), then asked at each length
(moejax.evaluation.recall, 256 rows of the "test" split). Variants: the NoPE hybrid as designed, MLA with
decoupled RoPE, KDA layers only, MLA layers only, and the KDA gate without its bound.

prefill: the config's weights (random: speed and memory do not depend on them) fed prompts of 128K to
1M tokens through the prefill path (`Engine.prefill`, pieces of inference.prefill_chunk), one row: the
seconds of the whole prompt after a compile, the device's peak memory, and whether the last logits are
finite. Then passkey mechanics (moejax.evaluation.passkey) at 128K and 1M: a prompt built and answered
greedily, its time and peak memory (accuracy means nothing on random weights).
"""

import argparse
import json
import os
import pathlib
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# id: (the table's name, overrides of experiments/mqar_tiny.py)
VARIANTS = {
    "nope": ("hybrid (NoPE MLA)", {}),
    "rope": ("hybrid, MLA with RoPE", {"model.mla.rope_head_dim": 8}),
    "kda": ("KDA only", {"model.layer_pattern": "K"}),
    "mla": ("MLA only (NoPE)", {"model.layer_pattern": "M"}),
    "unbounded": ("hybrid, unbounded KDA gate", {"model.kda.gate": "unbounded",
                                                 "model.kda.implementation": "recurrent"}),
}


def _log(*parts):
  print(time.strftime("%H:%M:%S"), *parts, flush=True)


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def kept_length(lengths: list[int]) -> int:
  """The length whose accuracy the target compares with the trained one's: the third (4K by default)."""
  return lengths[2] if len(lengths) > 2 else lengths[-1]


def train_and_ask(variant: str, args) -> tuple:
  """One variant of experiments/mqar_tiny.py trained (or resumed) in args.workdir/variant, then asked at
  each length: (name, final validation loss, training seconds, {length: accuracy})."""
  from moejax.config import load_experiment
  from moejax.evaluation.recall import mqar_accuracy
  from moejax.inference import load_model
  from moejax.training.loop import run

  name, overrides = VARIANTS[variant]
  c = load_experiment(ROOT / "experiments" / "mqar_tiny.py")
  seq_len, _, tokens = c.train.stages[0]
  c.train.stages = ((seq_len, args.steps, tokens),)
  c.train.update(eval_every=args.steps, checkpoint_every=args.steps, progress_bar=False)
  if args.smoke:
    c.train.stages = ((64, args.steps, 256),)
    c.data.mqar.pairs = 4
  if overrides.get("model.kda.implementation") is None:
    c.model.kda.implementation = "xla"  # the tiny model's head widths are below the kernels' tiles
  c.update_from_flattened_dict(overrides)
  workdir = os.path.join(args.workdir, variant)
  _log(f"{name}: training {args.steps} steps in {workdir}")
  started = time.perf_counter()
  final = run(c, workdir)
  trained_s = time.perf_counter() - started
  lm = load_model(workdir, cache_len=max(args.lengths) + 16)
  accuracy = {}
  for length in args.lengths:
    r = mqar_accuracy(lm, length, examples=args.examples, batch=max(1, min(64, 65536 // length)))
    accuracy[length] = r["accuracy"]
    _log(f"{name}: length {length}: accuracy {r['accuracy']:.3f} ({r['queries']} queries)")
  return name, final["val_loss"], trained_s, accuracy


def in_processes(args) -> list[tuple]:
  """train_and_ask of each variant in its own process, args.jobs at a time (a small model leaves most of
  a GPU idle), each with its share of the device's memory; the rows in args.variants' order."""
  import subprocess
  import sys
  import tempfile

  rows, running, queue = {}, [], list(args.variants)
  with tempfile.TemporaryDirectory() as tmp:
    def start(variant):
      out = os.path.join(tmp, f"{variant}.json")
      argv = [sys.executable, "-m", "benchmarks.long_context", "recall", "--variants", variant, "--jobs", "1",
              "--steps", str(args.steps), "--lengths", ",".join(map(str, args.lengths)), "--examples",
              str(args.examples), "--workdir", args.workdir, "--row-json", out]
      argv += ["--smoke"] if args.smoke else []
      env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / args.jobs:.3f}")
      return variant, out, subprocess.Popen(argv, cwd=ROOT, env=env)

    while queue or running:
      while queue and len(running) < args.jobs:
        running.append(start(queue.pop(0)))
      variant, out, proc = running.pop(0)
      if proc.wait() != 0:
        raise SystemExit(f"variant {variant} failed (exit {proc.returncode}); its log is above")
      name, loss, seconds, accuracy = json.loads(pathlib.Path(out).read_text())
      rows[variant] = (name, loss, seconds, {int(k): v for k, v in accuracy.items()})
  return [rows[v] for v in args.variants]


def recall(args) -> tuple[list[str], list]:
  if args.jobs > 1 and len(args.variants) > 1:
    rows = in_processes(args)
  else:
    rows = [train_and_ask(variant, args) for variant in args.variants]
  trained, keep_at = args.lengths[0], kept_length(args.lengths)
  lines = ["| model | val loss at the end | " + " | ".join(f"accuracy at {n}" for n in args.lengths)
           + f" | at {keep_at} / at {trained} |", "|---" * (len(args.lengths) + 3) + "|"]
  for name, loss, _, acc in rows:
    kept = acc[keep_at] / acc[trained] if acc[trained] else float("nan")
    lines.append(f"| {name} | {loss:.3f} | " + " | ".join(f"{acc[n]:.3f}" for n in args.lengths)
                 + f" | {kept:.2f} |")
  return lines, rows


def prefill(args, progress=lambda lines: None) -> tuple[list[str], dict]:
  """The table's lines and the figures; `progress(lines)` gets the table after each row, so that a run
  stopped by a time limit still leaves the rows it measured."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.generate import feed_prompt
  from moejax.config import load_experiment
  from moejax.data import tokenizer as tk
  from moejax.evaluation import passkey
  from moejax.inference import random_model
  from moejax.inference.engine import Rows
  from moejax.inference.loading import TextTokenizer

  c = load_experiment(args.config)
  if args.smoke:
    c = load_experiment(ROOT / "experiments" / "tiny.py")
    c.inference.prefill_chunk = 256
  device = jax.devices()[0]
  peak = lambda: (device.memory_stats() or {}).get("peak_bytes_in_use")
  live = lambda: (device.memory_stats() or {}).get("bytes_in_use")
  texts = [passkey.INTRO, passkey.FILLER, passkey.NEEDLE.format(key="12345"), passkey.QUESTION,
           " ".join(str(n) for n in range(2000))]
  tokenizer = TextTokenizer(tk.train_tokenizer(texts * 4, int(c.data.vocab_size)))
  lm = random_model(c, tokenizer=tokenizer, cache_len=max(args.lengths + args.passkey) + 64)
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lm.variables))
  _log(f"weights: {weights / 2**30:.2f} GiB on {device.device_kind}")
  lines = ["| prompt tokens | seconds | tokens/s | peak memory GiB | held after it GiB | MLA latents GiB | "
           "last logits finite |", "|---|---|---|---|---|---|---|"]
  results = {}
  for length in args.lengths:
    piece = min(lm.prefill_chunk, length)
    tokens = jax.random.randint(jax.random.key(1), (1, length), 3, lm.vocab_size, jnp.int32)
    full = jnp.full((1,), piece, jnp.int32)
    warm = lm.engine.prefill(Rows.empty(lm.model.cfg, 1, length), tokens[:, :piece], full)  # compiles
    jax.block_until_ready(warm.logits_BV)
    del warm
    rows = jax.block_until_ready(Rows.empty(lm.model.cfg, 1, length))
    t0 = time.perf_counter()
    rows = feed_prompt(lm, rows, tokens)
    seconds = time.perf_counter() - t0
    finite = bool(np.all(np.isfinite(np.asarray(rows.logits_BV))))
    latents = sum(x.size * x.dtype.itemsize for p, x in jax.tree_util.tree_flatten_with_path(rows.cache)[0]
                  if getattr(p[-1], "key", None) == "latent")
    held = None if live() is None else live() / 2**30  # the weights, the caches and the tokens
    del rows, tokens
    gib = None if peak() is None else peak() / 2**30
    results[length] = {"seconds": seconds, "peak_gib": gib, "held_gib": held, "finite": finite}
    _log(f"prefill {length}: {seconds:.1f} s, peak {gib} GiB, held {held} GiB, finite {finite}")
    show = lambda x: "n/a" if x is None else f"{x:.2f}"
    lines.append(f"| {length:,} | {seconds:.1f} | {length / seconds:,.0f} | {show(gib)} | {show(held)} | "
                 f"{latents / 2**30:.2f} | {finite} |")
    progress(lines)
  lines += ["", "Passkey mechanics (random weights: the answer is noise; the figures are time and memory):",
            "",
            "| prompt tokens | seconds (built, compiled, prefilled and answered) | peak memory GiB |",
            "|---|---|---|"]
  for length in args.passkey:
    t0 = time.perf_counter()
    r = passkey.passkey_accuracy(lm, [length], [0.5], trials=1)
    seconds = time.perf_counter() - t0
    gib = None if peak() is None else peak() / 2**30
    results[f"passkey {length}"] = {"seconds": seconds, "peak_gib": gib,
                                    "answer": r["lengths"][0]["depths"][0]}
    _log(f"passkey {length}: {seconds:.1f} s, answer {r['lengths'][0]['depths'][0]['answers']}")
    lines.append(f"| {length:,} | {seconds:.1f} | {'n/a' if gib is None else f'{gib:.1f}'} |")
    progress(lines)
  return lines, results


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("what", choices=("recall", "prefill"))
  parser.add_argument("--steps", type=int, default=1500, help="recall: training steps per variant")
  parser.add_argument("--lengths", type=_ints, default=None,
                      help="recall: evaluation lengths (default 256,1024,4096,16384); prefill: prompt "
                           "lengths (default 131072,262144,524288,1048576)")
  parser.add_argument("--examples", type=int, default=256, help="recall: rows per length")
  parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                      help=f"recall: which of {','.join(VARIANTS)} (default all)")
  parser.add_argument("--workdir", default="runs/long_context", help="recall: where the variants train")
  parser.add_argument("--config", default=str(ROOT / "experiments" / "h200.py"), help="prefill: the model")
  parser.add_argument("--passkey", type=_ints, default=[131072, 1048576], help="prefill: passkey lengths")
  parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  parser.add_argument("--json", default=None, help="also write the figures here")
  parser.add_argument("--jobs", type=int, default=1,
                      help="recall: variants trained at once, each in its own process (a GPU's share each)")
  parser.add_argument("--row-json", default=None, help=argparse.SUPPRESS)  # one variant's row, for --jobs
  parser.add_argument("--smoke", action="store_true", help="tiny and short, on the CPU; writes no table")
  args = parser.parse_args()
  unknown = set(args.variants) - set(VARIANTS)
  if unknown:
    parser.error(f"unknown variants {sorted(unknown)}: choose from {list(VARIANTS)}")
  if args.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.steps = min(args.steps, 3)
    args.examples = min(args.examples, 4)
    args.lengths = args.lengths or ([64, 128, 256] if args.what == "recall" else [512, 1024])
    args.passkey = [600]
  from moejax.device_memory import use_default_memory_fraction

  use_default_memory_fraction()  # before the backend starts
  import jax

  from benchmarks.report import provenance, publish

  if not args.smoke and jax.default_backend() != "gpu" and args.what == "prefill":
    raise SystemExit("prefill measures a GPU: run it on one, or pass --smoke")
  if args.jobs < 1:
    parser.error(f"--jobs must be >= 1, got {args.jobs}")
  if args.what == "recall":
    args.lengths = args.lengths or [256, 1024, 4096, 16384]
    if args.row_json:  # a process of --jobs: its variant's row only
      (variant,) = args.variants
      pathlib.Path(args.row_json).write_text(json.dumps(train_and_ask(variant, args)))
      return
    table, figures = recall(args)
    title = "Long-context recall (experiments/mqar_tiny.py)"
    from moejax.config import load_experiment

    recipe = load_experiment(ROOT / "experiments" / "mqar_tiny.py")
    seq_len, _, tokens = recipe.train.stages[0]
    notes = [f"Trained {args.steps} steps at {seq_len} tokens ({tokens // seq_len} rows a step; the "
             f"validation loss is on the queries alone), {args.examples} rows of {recipe.data.mqar.pairs} "
             f"queries per length; the last column is the share of its accuracy a model keeps at "
             f"{kept_length(args.lengths)} tokens. Target: the NoPE hybrid keeps at least 90% at 4K."]
  else:
    args.lengths = args.lengths or [131072, 262144, 524288, 1048576]
    title = "Long-context prefill (experiments/h200.py)"
    notes = ["Target: a 1M-token prefill on one GPU, memory linear in the length. Peak memory is the "
             "device's peak since the start of the process (lengths run shortest first)."]
    head = provenance(jax.devices()[0].device_kind) + [""] + notes + [""]
    partial = lambda lines: publish(None if args.smoke else args.out, title, head + lines + ["", "(partial)"])
    table, figures = prefill(args, partial)
  body = provenance(jax.devices()[0].device_kind) + [""] + notes + [""] + table
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(figures, default=str, indent=1))
  publish(None if args.smoke else args.out, title, body)


if __name__ == "__main__":
  main()
