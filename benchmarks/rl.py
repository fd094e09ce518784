"""Agentic RL: the reward curve of experiments/rl_tiny.py on the CPU, and rollout / update throughput of
multi-turn episodes on the GPU.

python -m benchmarks.rl curve [--workdir runs/rl_tiny_bench] [--out BENCHMARKS.md]
python -m benchmarks.rl throughput [--config experiments/h200.py] [--out BENCHMARKS.md] [--smoke]
    [--config.X=value ...]

- curve: runs `python -m moejax.rl --config experiments/rl_tiny.py` from scratch in a fresh workdir
  (SFT, then GRPO), timed whole, and reads its metrics.jsonl: the held-out arithmetic pass rate after
  SFT (RL's starting point) and at every evaluation, sampled at the rollout temperature and greedy.
  The curve goes to benchmarks/figures/rl_tiny.png.
- throughput: random weights of the config; episodes of 8K tokens: a 2K-token prompt, then turns of a
  512-token reply (decoded, eos ignored) and a 1K-token tool result (fed), through one `Conversation`
  per batch, as `moejax.rl.rollout.play` runs them. Rollout tokens/s counts drawn tokens (and drawn +
  fed). Update tokens/s: the policy objective's train step (`moejax.rl.objective`) over the same
  number of episodes of 8K tokens, in the config's microbatches. Overrides (`--config.X=value`, e.g.
  `--config.train.microbatch_tokens=16384 --config.model.remat=full`) apply to the loaded config, as
  `benchmarks.step --set` does; the table says which were used.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import provenance, publish

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURE = ROOT / "benchmarks" / "figures" / "rl_tiny.png"
KIND = "arithmetic"


def _log(*parts):
  print(time.strftime("%H:%M:%S"), *parts, flush=True)


def read_curve(workdir: str, sft_steps: int) -> list[dict]:
  """[{iteration, sampled, greedy}] of every evaluation row (iteration 0: after SFT)."""
  points = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if f"eval/pass_rate/{KIND}" in row:
        points.append({"iteration": int(row.get("iteration", 0)), "sampled": row[f"eval/pass_rate/{KIND}"],
                       "greedy": row[f"eval_greedy/pass_rate/{KIND}"],
                       "tool_calls": row["eval/tool_calls"]})
  del sft_steps
  return points


def plot(points, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  path.parent.mkdir(parents=True, exist_ok=True)
  fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
  its = [p["iteration"] for p in points]
  ax.plot(its, [p["sampled"] for p in points], "o-", label="sampled (T=1)")
  ax.plot(its, [p["greedy"] for p in points], "s--", label="greedy")
  ax.set_xlabel("GRPO iteration (0: after SFT)")
  ax.set_ylabel("held-out arithmetic pass rate")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def curve(args) -> None:
  from moejax.config import load_experiment

  config = load_experiment(ROOT / "experiments" / "rl_tiny.py")
  if os.path.exists(args.workdir):
    shutil.rmtree(args.workdir)  # from scratch: the time is that of a whole run
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "moejax.rl", "--config", str(ROOT / "experiments" / "rl_tiny.py"),
                  "--workdir", args.workdir, *args.overrides], check=True)
  minutes = (time.perf_counter() - start) / 60
  points = read_curve(args.workdir, int(config.rl.sft.steps))
  if not points or points[0]["iteration"] != 0:
    raise SystemExit("the run logged no evaluation after SFT")
  plot(points, FIGURE)
  first, last = points[0], points[-1]
  gain = last["sampled"] - first["sampled"]
  lines = provenance(f"CPU ({os.cpu_count()} cores)") + [
      f"`experiments/rl_tiny.py` from scratch: SFT ({config.rl.sft.steps} steps on "
      f"{config.rl.sft.examples} generated demonstrations, half answering without the calculator), then "
      f"{config.rl.grpo.iterations} GRPO iterations of {config.rl.grpo.groups} x {config.rl.grpo.group_size} "
      f"episodes. Held-out pass rate on {config.rl.eval.tasks} arithmetic tasks, one sample each at "
      f"temperature {config.rl.grpo.temperature} and one greedy. Whole run: {minutes:.1f} min.", "",
      "| iteration | pass rate (sampled) | pass rate (greedy) | tool calls per episode |",
      "|---|---|---|---|"]
  lines += [f"| {p['iteration']} | {p['sampled']:.3f} | {p['greedy']:.3f} | {p['tool_calls']:.2f} |"
            for p in points]
  target = "met" if gain >= 0.3 and minutes <= 20 else "NOT met"
  lines += ["", f"Gain over the SFT starting point: {gain:+.3f} (sampled), "
            f"{last['greedy'] - first['greedy']:+.3f} (greedy); target +0.30 within 20 min: {target}.", "",
            f"![pass rate](benchmarks/figures/{FIGURE.name})"]
  publish(args.out, "Agentic RL (experiments/rl_tiny.py)", lines)


def throughput(args) -> None:
  from benchmarks.step_setup import load_config
  from moejax.config import passes_per_step
  from moejax.device_memory import use_default_memory_fraction
  from moejax.inference.conversation import Conversation
  from moejax.inference.loading import from_variables
  from moejax.model import build_model
  from moejax.rl.batch import update_batch
  from moejax.rl.objective import policy_objective
  from moejax.rl.transcript import Transcript
  from moejax.training.state import init_state
  from moejax.training.step import jit_train_step

  # As benchmarks/step.py: XLA gets 95% of the card (unless the environment chose), not JAX's default 75%,
  # which leaves the update step of experiments/h200.py short. Before JAX starts its backend.
  use_default_memory_fraction()
  overrides = [o.removeprefix("--").removeprefix("config.") for o in args.overrides]
  path = ROOT / "experiments" / "rl_tiny.py" if args.smoke else args.config
  config = load_config(str(path), overrides)
  if args.smoke:
    prompt, reply, result, episode, batch = 64, 16, 32, 256, 2
  else:
    if jax.default_backend() != "gpu":
      raise SystemExit("benchmarks/rl.py throughput needs a GPU; use --smoke on the CPU")
    prompt, reply, result, episode, batch = 2048, 512, 1024, 8192, args.batch
  if "rl" not in config:
    from moejax.rl.config import rl_config

    config.rl = rl_config()
  device = jax.devices()[0].device_kind
  # One random initialisation, the train state's, on the host CPU and then moved to the accelerator, where
  # drawing experiments/h200.py's state takes minutes (benchmarks/step_setup.py, init_on_host, says why).
  # The rollout's weights are its params in the model's dtype (`from_variables`, as `random_model` does).
  model = build_model(config)
  _log("initialising the train state on the host")
  state, optimizer, _ = init_state(model, config, jax.random.key(0), 10, device=jax.devices("cpu")[0])
  state = jax.device_put(state, jax.devices()[0])
  jax.block_until_ready(state)
  _log("initialised; building the rollout model")
  lm = from_variables(config, {"params": state.params, "balance": state.balance}, cache_len=episode + reply)
  rng = np.random.default_rng(0)
  vocab = lm.vocab_size
  ids = lambda n: rng.integers(3, vocab, n).tolist()

  def rollout(lm):
    conversation = Conversation(lm, batch, seed=0)
    transcripts = [Transcript() for _ in range(batch)]
    feeds = [ids(prompt) for _ in range(batch)]
    drawn = fed = 0
    while len(transcripts[0]) + len(feeds[0]) + reply <= episode:
      for t, f in zip(transcripts, feeds, strict=True):
        t.add_context(f)
      fed += sum(map(len, feeds))
      out = conversation.turn(feeds, max_new_tokens=reply, temperature=1.0)
      for t, tokens, logp in zip(transcripts, out.tokens, out.logprobs, strict=True):
        t.add_policy(tokens, logp, 0)
      drawn += sum(map(len, out.tokens))
      feeds = [ids(result) for _ in range(batch)]
    return transcripts, drawn, fed

  _log("rollout: compiling (one untimed rollout)")
  rollout(lm)  # compiles
  _log("rollout: timing")
  start = time.perf_counter()
  transcripts, drawn, fed = rollout(lm)
  rollout_s = time.perf_counter() - start
  _log(f"rollout: {batch} episodes of {len(transcripts[0])} tokens, {drawn} drawn in {rollout_s:.2f} s")

  del lm  # the rollout's weights (in the model's dtype) and cache: the update has the state's
  step = jit_train_step(model, optimizer, config, 10, loss_fn=policy_objective(config.rl.grpo))
  arrays = update_batch(transcripts, rng.normal(size=batch).tolist(), version=0, aggregation="token-mean")
  arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
  rows, row_len = arrays["tokens"].shape
  passes = passes_per_step(row_len, rows * row_len, config.train.microbatch_tokens)
  settings = (f"train.microbatch_tokens={config.train.microbatch_tokens} ({passes} pass"
              f"{'es' if passes > 1 else ''} of {rows // passes} x {row_len:,} positions), "
              f"model.remat={config.model.remat}")
  _log(f"update: compiling, {rows} x {row_len:,} positions, {settings}")
  start = time.perf_counter()
  state, metrics = step(state, arrays)  # compiles
  float(metrics["loss"])
  _log(f"update: compiled and ran once in {time.perf_counter() - start:.1f} s")
  repeats = 1 if args.smoke else 3
  start = time.perf_counter()
  for i in range(repeats):
    state, metrics = step(state, arrays)
    float(metrics["loss"])
    _log(f"update: step {i + 1}/{repeats} done at {time.perf_counter() - start:.2f} s")
  update_s = (time.perf_counter() - start) / repeats
  tokens = int(np.sum(np.asarray(arrays["segment_ids"]) > 0))
  lines = provenance(device) + [
      f"Model `{'rl_tiny.py' if args.smoke else pathlib.Path(args.config).name}` (random weights, "
      f"{config.model.dtype}); {batch} episodes of "
      f"{len(transcripts[0]):,} tokens: a {prompt:,}-token prompt, then turns of a {reply}-token reply and a "
      f"{result:,}-token tool result. XLA_PYTHON_CLIENT_MEM_FRACTION="
      f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.75 (JAX default)')}. Update: {settings}"
      f"{'; overrides: ' + ', '.join(f'`{o}`' for o in overrides) if overrides else ''}; mean of "
      f"{repeats} step{'s' if repeats > 1 else ''} after the compiling one; tokens count the episodes' "
      f"predictions, not the rows' padding.", "",
      "| part | seconds | tokens | tokens/s |", "|---|---|---|---|",
      f"| rollout (drawn) | {rollout_s:.2f} | {drawn:,} | {drawn / rollout_s:,.0f} |",
      f"| rollout (drawn + fed) | {rollout_s:.2f} | {drawn + fed:,} | {(drawn + fed) / rollout_s:,.0f} |",
      f"| update (one policy step) | {update_s:.2f} | {tokens:,} | {tokens / update_s:,.0f} |"]
  publish(None if args.smoke else args.out, "Agentic RL throughput", lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="part", required=True)
  c = sub.add_parser("curve")
  c.add_argument("--workdir", default="runs/rl_tiny_bench")
  c.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  c.add_argument("overrides", nargs="*", help="--config.rl....=value flags for the run")
  t = sub.add_parser("throughput")
  t.add_argument("--config", default=str(ROOT / "experiments" / "h200.py"))
  t.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  t.add_argument("--batch", type=int, default=16)
  t.add_argument("--smoke", action="store_true", help="tiny shapes (CPU); prints, writes no table")
  t.add_argument("overrides", nargs="*",
                 help="--config.X=value flags for the loaded config, e.g. "
                      "--config.train.microbatch_tokens=16384")
  args, rest = parser.parse_known_args()
  # argparse takes --config.X=value for an unknown option: they are the overrides.
  unknown = [a for a in rest if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  args.overrides = [*args.overrides, *rest]
  curve(args) if args.part == "curve" else throughput(args)


if __name__ == "__main__":
  main()
