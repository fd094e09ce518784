"""Expert balance at scale: experiments/h200.py's model trained on the embedded corpus once per balance mode,
with the same seed and data order, and the load of every MoE layer read from each step's metrics.

python -m benchmarks.balance --gpu [--steps 1000] [--shapes h200,e256,k3]
                                   [--modes quantile,frozen,sign,aux,oracle,smoothed] [--frozen-steps 100]
                                   [--workdir runs/balance] [--time-limit-s 540] [--out BENCHMARKS.md]

Shapes: "h200" is experiments/h200.py (64 routed experts, top 8); "e256" the same with 256 experts, top
8, each a quarter as wide (the same expert parameters); "k3" experiments/k3.py's MoE, 896 experts top
16 and two shared ones, at the h200 model's width (expert hidden 64). Each trains at 32K tokens a step
(4 rows of 8K, one pass) for --steps steps. Modes: model.moe.balance "quantile", "sign" and "aux";
"smoothed", quantile with model.moe.quantile_smoothing (the bias an average of the solves); and two
diagnostics that are not training recipes:
- "oracle": quantile with model.moe.quantile_oracle, each batch routed with the bias solved on itself,
  which is not causal: what it leaves is the solver's.
- "frozen": the finished quantile run continued for FROZEN_STEPS steps with train.update_params=False,
  the router fixed and the bias still solved on each batch for the next. Its imbalance is the batches'
  content alone; quantile's over its last FROZEN_STEPS steps is content and the bias lagging behind a
  moving router. It starts from the quantile run's last checkpoint, so it runs after quantile.

The runs live in --workdir/<shape>/<mode>; a call stops itself near --time-limit-s (train.time_limit_s,
which saves a checkpoint) and the next call with the same arguments resumes where it stopped. Each call
rewrites the section with every run's figures so far, a run cut short marked with its step, and the
PNG benchmarks/figures/balance_gpu.png. A finished run's checkpoint is deleted (its metrics stay): the
model's state is about 11 GB. XLA's compiled programs are kept in --workdir/xla-cache (unless
JAX_COMPILATION_CACHE_DIR says where), so a resuming call does not compile its step again.
"""

import json
import logging
import os
import pathlib
import shutil
import time

import numpy as np

from benchmarks.report import commit, publish
from moejax.report import ReportError, load_rows

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURE = ROOT / "benchmarks" / "figures" / "balance_gpu.png"
TITLE = "Expert balance at scale (experiments/h200.py)"
SHAPES = {
    "h200": ("64 experts top-8 (experiments/h200.py)", {}),
    "e256": ("256 experts top-8, each 1/4 as wide", {"model.moe.num_experts": 256,
                                                       "model.moe.expert_hidden_dim": 192}),
    "k3": ("896 experts top-16, 2 shared (k3's MoE, expert hidden 64)",
           {"model.moe.num_experts": 896, "model.moe.top_k": 16, "model.moe.num_shared": 2,
            "model.moe.expert_hidden_dim": 64}),
}
SMOOTHING = 0.8  # "smoothed": model.moe.quantile_smoothing
MODES = {
    "quantile": {"model.moe.balance": "quantile"},
    "sign": {"model.moe.balance": "sign"},
    "aux": {"model.moe.balance": "aux"},
    "oracle": {"model.moe.balance": "quantile", "model.moe.quantile_oracle": True},
    "smoothed": {"model.moe.balance": "quantile", "model.moe.quantile_smoothing": SMOOTHING},
    "frozen": {"model.moe.balance": "quantile", "train.update_params": False},
}
FROZEN_STEPS = 100  # "frozen" continues the finished quantile run this many steps (--frozen-steps)
SETTLED = 0.5  # the worst layer's MaxVio_batch that a settled run stays below
FROM_STEP = 50  # the statistics over steps skip the warmup's first steps
SEQ_LEN, TOKENS = 8192, 32768


def run_config(shape: str, mode: str, steps: int, smoke: bool = False, frozen_steps: int = FROZEN_STEPS):
  """experiments/h200.py (experiments/tiny.py for --smoke) at 32K tokens a step in one pass, with the
  shape's and the mode's overrides."""
  from moejax.config import load_experiment

  c = load_experiment(ROOT / "experiments" / ("tiny.py" if smoke else "h200.py"))
  seq_len, tokens = (128, 512) if smoke else (SEQ_LEN, TOKENS)
  steps = target_step(mode, steps, frozen_steps)
  overrides = {**SHAPES[shape][1], **MODES[mode]}
  if smoke:  # the shapes' expert counts at the tiny model's widths
    overrides = {k: v for k, v in overrides.items() if not k.endswith("hidden_dim")}
  c.update_from_flattened_dict(overrides)
  # One checkpoint, written where a call's time runs out (train.time_limit_s) or at the end: a save of
  # the h200 model's state is about 11 GB, and three kept per run of several would fill the disk.
  c.train.update(stages=((seq_len, steps, tokens),), microbatch_tokens=0, seed=0,
                 log_every=5 if smoke else 10, eval_every=steps, eval_batches=1 if smoke else 4,
                 checkpoint_every=steps, keep_checkpoints=1, progress_bar=False)
  return c


def target_step(mode: str, steps: int, frozen_steps: int = FROZEN_STEPS) -> int:
  """The step a mode's run ends at: "frozen" continues the quantile run `frozen_steps` past its end."""
  return steps + frozen_steps if mode == "frozen" else steps


def order_modes(modes: list[str]) -> list[str]:
  """The modes in the order they train: "frozen" right after "quantile", whose checkpoint it starts from
  (and which is deleted once frozen has taken it)."""
  rest = [m for m in modes if m != "frozen"]
  if "frozen" in modes:
    at = rest.index("quantile") + 1 if "quantile" in rest else 0
    rest.insert(at, "frozen")
  return rest


def start_frozen(shape_dir: str, steps: int) -> str | None:
  """Puts the finished quantile run's last checkpoint into the frozen run's workdir, unless it has one;
  returns why it cannot start, or None."""
  own = os.path.join(shape_dir, "frozen", "checkpoints")
  if os.path.isdir(own) and os.listdir(own):
    return None
  quantile = os.path.join(shape_dir, "quantile")
  if reached(quantile) < steps:
    return f"it continues the quantile run, which has not reached step {steps}"
  source = os.path.join(quantile, "checkpoints", str(steps))
  if not os.path.isdir(source):
    return (f"it starts from the quantile run's checkpoint of step {steps}, which is gone (deleted once "
            f"a run is done): train quantile again with frozen in the same --modes")
  shutil.copytree(source, os.path.join(own, str(steps)))
  return None


def last_step(rows: list[dict]) -> int:
  """The last step of a run's metrics rows (0 before its first)."""
  return rows[-1]["step"] if rows else 0


def reached(workdir: str) -> int:
  """The last step a run has logged (0 before its first)."""
  return last_step(read_rows(workdir))


def read_rows(workdir: str) -> list[dict]:
  """The run's metrics rows in step order (moejax.report.load_rows: a line cut short by a kill is
  skipped); none where the run has not logged a step yet."""
  try:
    return load_rows(workdir)
  except ReportError:
    return []


def layer_names(row: dict) -> list[str]:
  """The MoE layers of a metrics row, in layer order ("moe/layer_3/moe")."""
  suffix = "/maxvio_batch"
  names = [k[:-len(suffix)] for k in row if k.startswith("moe/layer_") and k.endswith(suffix)]
  return sorted(names, key=lambda n: int(n.split("/")[1].split("_")[1]))


def settling_step(worst: np.ndarray, steps: np.ndarray, limit: float = SETTLED) -> int | None:
  """The first step from which the worst layer's MaxVio_batch stays below `limit` to the end; None if
  the last step is not below it."""
  above = np.nonzero(worst >= limit)[0]
  if len(above) == 0:
    return int(steps[0])
  if above[-1] == len(worst) - 1:
    return None
  return int(steps[above[-1] + 1])


def persistence(train: list[dict]) -> float:
  """How much of each expert's load excess outlasts a batch: the correlation of every (layer, expert)'s
  load over its fair share between consecutive logged steps (train.log_every apart), from FROM_STEP on,
  averaged. Near 0 the excesses are the batches' own (content); a bias lagging behind the router
  leaves the same experts over- or underloaded step after step, and the correlation high."""
  layers = layer_names(train[0])
  logged = [r for r in train if r["step"] >= FROM_STEP and f"{layers[0]}/load" in r]
  if len(logged) < 3:
    return float("nan")
  corrs = []
  for n in layers:
    load = np.array([r[f"{n}/load"] for r in logged], np.float64)  # [logged steps, experts]
    excess = load / load.mean(axis=1, keepdims=True) - 1.0
    a, b = excess[:-1] - excess[:-1].mean(axis=0), excess[1:] - excess[1:].mean(axis=0)
    spread = np.sqrt((a * a).sum(axis=0) * (b * b).sum(axis=0))
    corrs += list((a * b).sum(axis=0)[spread > 0] / spread[spread > 0])
  return float(np.mean(corrs)) if corrs else float("nan")


def summarise(rows: list[dict]) -> dict:
  """The figures of one run from its metrics rows (one per step)."""
  train = [r for r in rows if "loss" in r]
  layers = layer_names(train[0])
  steps = np.array([r["step"] for r in train])
  maxvio = np.array([[r[f"{n}/maxvio_batch"] for n in layers] for r in train])  # [steps, layers]
  worst, median = maxvio.max(axis=1), np.median(maxvio, axis=1)
  later = steps >= FROM_STEP
  val = [r for r in rows if "val_loss" in r]
  return {
      "first": int(steps[0]),
      "step": int(steps[-1]),
      "worst_median": float(np.median(worst[later])) if later.any() else float("nan"),
      "worst_max": float(worst[later].max()) if later.any() else float("nan"),
      "layer_median": float(np.median(median[later])) if later.any() else float("nan"),
      "global_end": float(train[-1]["moe/maxvio_global"]),
      "settled_at": settling_step(worst, steps),
      "persistence": persistence(train),
      "dropped": float(sum(r.get("moe/dropped", 0.0) for r in train)),
      "loss_end": float(np.mean([r["loss"] for r in train[-10:]])),
      "val_loss": val[-1]["val_loss"] if val else None,
      "val_step": val[-1]["step"] if val else None,
  }


def table(results: dict, steps: int) -> list[str]:
  missing = lambda v: v is None or (isinstance(v, float) and np.isnan(v))
  fmt = lambda v, spec=".3f": "n/a" if missing(v) else format(v, spec)
  lines = [f"| shape | mode | steps | worst layer's MaxVio_batch, steps {FROM_STEP}-end: median / max | "
           f"mean over layers: median | MaxVio_global at the end | settled below {SETTLED} from step | "
           f"load excess kept over a logging interval (correlation) | dropped tokens | loss (last 10) | "
           f"validation loss |", "|---" * 11 + "|"]
  for (shape, mode), r in results.items():
    target = r.get("target", steps)
    span = f"{r['first']}-{r['step']}" if r["first"] > 1 else f"{r['step']}"
    reached = span if r["step"] >= target else f"{span} of {target} (cut short)"
    val = "n/a" if r["val_loss"] is None else f"{r['val_loss']:.3f} (step {r['val_step']})"
    lines.append(f"| {shape} | {mode} | {reached} | {fmt(r['worst_median'])} / {fmt(r['worst_max'])} | "
                 f"{fmt(r['layer_median'])} | {fmt(r['global_end'])} | {fmt(r['settled_at'], 'd')} | "
                 f"{fmt(r.get('persistence'), '.2f')} | {r['dropped']:.0f} | {r['loss_end']:.3f} | {val} |")
  return lines


def worst_layer_median(rows: list[dict], first: int, last: int) -> float:
  """The median over steps first..last of the worst layer's MaxVio_batch."""
  train = [r for r in rows if "loss" in r and first <= r["step"] <= last]
  layers = layer_names(train[0])
  return float(np.median([max(r[f"{n}/maxvio_batch"] for n in layers) for r in train]))


def lag_and_content(runs: dict, steps: int, frozen_steps: int = FROZEN_STEPS) -> list[str]:
  """Per shape with both runs done: quantile's imbalance over its last `frozen_steps` steps against the
  frozen router's over the next `frozen_steps`, the same bias rule on the same stream of batches."""
  lines = []
  for (shape, mode), frozen in runs.items():
    quantile = runs.get((shape, "quantile"))
    if mode != "frozen" or quantile is None or frozen[-1]["step"] < steps + frozen_steps:
      continue
    moving = worst_layer_median(quantile, steps - frozen_steps + 1, steps)
    fixed = worst_layer_median(frozen, steps + 1, steps + frozen_steps)
    lines.append(f"- {shape}: the worst layer's MaxVio_batch, median over steps {steps - frozen_steps + 1}-"
                 f"{steps} of quantile (content and lag) {moving:.3f}; over steps {steps + 1}-"
                 f"{steps + frozen_steps} with the router frozen (content alone) {fixed:.3f}.")
  if lines:
    lines.insert(0, "Where quantile's imbalance comes from, the batches' content or the bias lagging behind "
                    "the router:")
  return lines


def plot(runs: dict, path: pathlib.Path) -> None:
  """Per shape: MaxVio_batch over steps (worst layer, and median over layers) for each mode; per run,
  the per-expert load of the layer worst on average, over the logged steps."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  shapes = sorted({s for s, _ in runs}, key=list(SHAPES).index)
  cols = 1 + max(sum(1 for s, _ in runs if s == shape) for shape in shapes)
  fig, axes = plt.subplots(len(shapes), cols, figsize=(4.5 * cols, 3.4 * len(shapes)), squeeze=False)
  def worst_loads(train):
    """The logged steps and [experts, steps] loads of the layer whose MaxVio_batch is worst on average."""
    layers = layer_names(train[0])
    mean = np.mean([[r[f"{n}/maxvio_batch"] for n in layers] for r in train], axis=0)
    layer = layers[int(np.argmax(mean))]
    logged = [r for r in train if f"{layer}/load" in r]
    return layer, logged, np.array([r[f"{layer}/load"] for r in logged]).T

  for i, shape in enumerate(shapes):
    ax = axes[i][0]
    modes = [m for s, m in runs if s == shape]
    # One colour scale for the shape's heatmaps, so that the modes compare by eye.
    top = max((float(np.max(worst_loads([r for r in runs[shape, m] if "loss" in r])[2], initial=1.0))
               for m in modes), default=1.0)
    for j, mode in enumerate(modes):
      train = [r for r in runs[shape, mode] if "loss" in r]
      layers = layer_names(train[0])
      steps = [r["step"] for r in train]
      maxvio = np.array([[r[f"{n}/maxvio_batch"] for n in layers] for r in train])
      ax.plot(steps, maxvio.max(axis=1), color=f"C{j}", lw=0.7, label=f"{mode}: worst layer")
      ax.plot(steps, np.median(maxvio, axis=1), color=f"C{j}", lw=0.7, ls="--", label=f"{mode}: median")
      worst_layer, logged, load = worst_loads(train)
      heat = axes[i][1 + j]
      if logged:
        image = heat.imshow(load, aspect="auto", origin="lower", cmap="magma", vmin=0.0, vmax=top,
                            extent=(logged[0]["step"], logged[-1]["step"], 0, load.shape[0]))
        fig.colorbar(image, ax=heat, label="load / fair share")
      heat.set(title=f"{shape} {mode}: {worst_layer.split('/')[1]}", xlabel="step", ylabel="expert")
    ax.axhline(SETTLED, color="gray", lw=0.5)
    ax.set(yscale="log", title=f"{shape}: MaxVio_batch", xlabel="step")
    ax.legend(fontsize=6)
    for extra in axes[i][1 + len(modes):]:
      extra.axis("off")
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(args) -> None:
  from moejax.device_memory import use_default_memory_fraction

  use_default_memory_fraction()  # as `python -m moejax.train`: the h200 step does not fit JAX's default 75%
  import jax

  # The loop's phases with their times (state, compile, time limit, saves): what a call spends before
  # its first step is time its runs do not train.
  logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
  logging.getLogger("moejax").setLevel(logging.INFO)

  from moejax.data.prepare import load_manifest, prepare
  from moejax.training.loop import run

  if not args.smoke and jax.default_backend() != "gpu":
    raise SystemExit("benchmarks.balance --gpu needs a GPU; add --smoke for the tiny model on the CPU")
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    # XLA's persistent cache beside the runs: a call that resumes a run loads its step instead of
    # compiling it again.
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.join(args.workdir, "xla-cache")))
  began = time.perf_counter()
  results, runs, stopped, skipped = {}, {}, None, []
  modes = order_modes(args.modes)
  for shape in args.shapes:
    shape_dir = os.path.join(args.workdir, shape)
    last = {}  # the last step each run has logged
    for mode in modes:
      workdir = os.path.join(shape_dir, mode)
      target = target_step(mode, args.steps, args.frozen_steps)
      left = args.time_limit_s - (time.perf_counter() - began)
      rows = read_rows(workdir)
      if last_step(rows) < target and stopped is None and left > args.min_run_s:
        why_not = start_frozen(shape_dir, args.steps) if mode == "frozen" else None
        if why_not is None:
          config = run_config(shape, mode, args.steps, args.smoke, args.frozen_steps)
          config.train.time_limit_s = left
          print(f"{shape} {mode}: training in {workdir} ({left:.0f} s left)", flush=True)
          run(config, workdir)
          rows = read_rows(workdir)
          if last_step(rows) < target:
            stopped = (shape, mode)
        else:
          skipped.append(f"{shape} frozen did not run: {why_not}.")
      last[mode] = last_step(rows)
      if mode == "frozen":
        rows = [r for r in rows if r["step"] > args.steps]
      if any("loss" in r for r in rows):
        runs[shape, mode] = rows
        results[shape, mode] = {**summarise(rows), "target": target}
    # The figures come from the metrics; a finished run's state would only take the disk, but for
    # quantile's last one while frozen has still to start from it.
    done = {mode: last[mode] >= target_step(mode, args.steps, args.frozen_steps) for mode in modes}
    for mode in modes:
      if done[mode] and not (mode == "quantile" and "frozen" in modes and not done["frozen"]):
        shutil.rmtree(os.path.join(shape_dir, mode, "checkpoints"), ignore_errors=True)
  if not results:
    raise SystemExit("no run has trained a step yet: give --time-limit-s more time")
  device = "CPU (smoke)" if args.smoke else jax.devices()[0].device_kind
  config = run_config(args.shapes[0], args.modes[0], args.steps, args.smoke)
  seq_len, _, tokens = config.train.stages[0]
  corpus = load_manifest(prepare(config.data))["splits"]["train"]["tokens"]  # prepared already: a lookup
  lines = [f"Command: `python -m benchmarks.balance --gpu {' '.join(args.argv)}`  ",
           f"Date: {time.strftime('%Y-%m-%d')}, device: {device}, commit: {commit()}.", "",
           f"{seq_len}-token rows, {tokens} tokens a step in one pass, on the embedded stdlib corpus "
           f"({corpus:,} training tokens: {args.steps} steps pass over it {args.steps * tokens / corpus:.1f} "
           f"times); seed and data order alike in every run. MaxVio_batch per layer and step from the "
           f"metrics log; the statistics start at step {FROM_STEP}. 'oracle' routes each batch with the "
           f"bias solved on itself (not causal; model.moe.quantile_oracle); 'frozen' continues the "
           f"finished quantile run with the parameters fixed (train.update_params=False); 'smoothed' "
           f"averages the solves (model.moe.quantile_smoothing={SMOOTHING}).", "",
           *table(results, args.steps)]
  why = lag_and_content(runs, args.steps, args.frozen_steps)
  if why:
    lines += ["", *why]
  if skipped:
    lines += ["", *skipped]
  if stopped is not None:
    lines += ["", f"Cut short at {stopped[0]} {stopped[1]} by --time-limit-s; the same command resumes."]
  if not args.smoke or args.figure:
    figure = pathlib.Path(args.figure) if args.figure else FIGURE
    plot(runs, figure)
    lines += ["", f"![MaxVio over steps and the worst layer's load]({os.path.relpath(figure, ROOT)})"]
  publish(None if args.smoke else args.out, TITLE, lines)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({f"{s} {m}": r for (s, m), r in results.items()}, f, indent=1)
