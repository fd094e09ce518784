"""The training pipeline end to end on CPU: `moejax.training.loop.run` on the embedded corpus.

One reference run (two context stages, checkpoints every 10 steps) is shared; the other runs resume
from copies of its checkpoints and must reproduce its losses and final parameters bit for bit.
The persistent compilation cache is on for this module: every run retraces its steps, and with the
cache only the first run pays for XLA compilation.
"""

import hashlib
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
import runs
from jax.experimental.compilation_cache import compilation_cache
from tensorboardX.proto import event_pb2

from moejax.config import base_config
from moejax.data.prepare import prepare
from moejax.data.streams import StreamIterator
from moejax.errors import ConfigError
from moejax.flops import model_flops_per_token
from moejax.model import build_model
from moejax.training import checkpoint as ckpt_lib
from moejax.training import loop, run_files
from moejax.training.monitor import Monitor
from moejax.training.optimizers import learning_rate_schedule
from moejax.training.state import init_state

# (seq_len, steps, tokens per batch). Validation every 10 steps falls in stage 0 only, which saves
# compiling the eval step for the second length.
STAGES = ((64, 20, 512), (128, 8, 512))
TOTAL = 28
MOE_LAYERS = ("layer_0", "layer_1")
# Shared by the in-process runs and the config file of the subprocess that gets killed.
OVERRIDES = {
    **runs.SMALL_MODEL,
    "train.stages": STAGES, "train.checkpoint_every": 10, "train.keep_checkpoints": 5,
    "train.eval_every": 10, "train.eval_batches": 2, "train.log_every": 1, "train.progress_bar": False,
}
# Timing, and logged only at steps where it was measured: a resumed process's first step compiles.
NONDETERMINISTIC = {"tokens_per_s"}
# The steps that compile the train step in the reference run (a stage's first): no throughput.
COMPILE_STEPS = (1, 21)


def _set(c, dotted, value):
  *parents, leaf = dotted.split(".")
  for p in parents:
    c = c[p]
  c[leaf] = value


def make_config(cache_dir, **overrides):
  c = base_config()
  for k, v in {**OVERRIDES, "data.cache_dir": str(cache_dir), **overrides}.items():
    _set(c, k, v)
  return c


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
  """A folder that all xdist workers of this session see: the reference run and the caches are
  built once (under `runs.locked`), not once per worker that gets some of these tests."""
  return runs.session_folder(tmp_path_factory, "moejax_train")


@pytest.fixture(scope="module", autouse=True)
def compilation_cache_dir(shared):
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  before = {n: getattr(jax.config, n) for n in names}
  path = str(shared / "jax_cache")
  for n, v in zip(names, (path, 0.0, 0), strict=True):
    jax.config.update(n, v)
  compilation_cache.reset_cache()  # the cache is set up once per process: make it see the new dir
  yield path
  for n, v in before.items():
    jax.config.update(n, v)
  compilation_cache.reset_cache()


class _Tap(StreamIterator):
  """Passes batches through `fn(index, batch) -> batch`; checkpoints as its parent."""

  def __init__(self, parent, fn):
    super().__init__(parent.iterators, parent.total)
    self.fn, self.index = fn, 0

  def __next__(self):
    batch = self.fn(self.index, super().__next__())
    self.index += 1
    return batch


def _tap_iterators(monkeypatch, fn):
  original = loop._iterator_for_step
  monkeypatch.setattr(loop, "_iterator_for_step",
                      lambda *args: _Tap(original(*args), fn))


def iterator_for_step(config, step, stages=STAGES):
  """The loop's train data of `step` in a one-process run."""
  return loop._iterator_for_step(config, [tuple(s) for s in stages], step, prepare(config.data), 1)


def pin_run(workdir, config, stages, step, streams=1) -> bool:
  """What the loop does with run.json at a (re)start: checks it, then rewrites it; returns `fresh`."""
  fresh, pin = run_files.check_run(workdir, config, stages, step, run_files.read_run_pin(workdir), streams)
  run_files.write_json(os.path.join(workdir, "run.json"), pin)
  return fresh


def read_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def restore_state(config, workdir, step):
  model = build_model(config)
  template, _, _ = init_state(model, config, jax.random.key(0), TOTAL)
  manager = ckpt_lib.Manager(os.path.join(workdir, "checkpoints"), 5)
  it = iterator_for_step(config, step)
  return jax.device_get(manager.restore(step, template, it)[0])


def copy_checkpoints(src, dst, steps):
  for s in steps:
    shutil.copytree(os.path.join(src, "checkpoints", str(s)), os.path.join(dst, "checkpoints", str(s)))


def assert_same_rows(got, want):
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want, strict=True):
    assert set(g) - NONDETERMINISTIC == set(w) - NONDETERMINISTIC
    for k in set(g) - NONDETERMINISTIC:
      assert g[k] == w[k] or (np.isnan(g[k]) and np.isnan(w[k])), (g["step"], k, g[k], w[k])


def assert_same_params(a, b):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
    assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def reference(shared):
  """The uninterrupted run: 20 steps at seq_len 64, then 8 at 128; what each batch was, recorded."""
  workdir, summary = shared / "reference", shared / "reference.json"
  config = make_config(shared / "data")
  with runs.locked(shared / "reference.lock"):
    if not summary.exists():
      shutil.rmtree(workdir, ignore_errors=True)
      shapes, digests = [], []

      def record(i, batch):
        shapes.append(batch["tokens"].shape)
        digests.append(_digest(batch))
        return batch

      with pytest.MonkeyPatch.context() as mp:
        _tap_iterators(mp, record)
        final = loop.run(config, str(workdir))
      summary.write_text(json.dumps({"final": final, "shapes": shapes, "digests": digests}))
  info = json.loads(summary.read_text())
  return {"config": config, "workdir": str(workdir), "rows": read_rows(workdir), "final": info["final"],
          "shapes": [tuple(x) for x in info["shapes"]], "digests": info["digests"]}


def _digest(batch) -> str:
  return hashlib.sha256(b"".join(np.ascontiguousarray(batch[k]).tobytes() for k in sorted(batch))).hexdigest()


def test_tiny_run_lowers_the_loss(reference):
  losses = [r["loss"] for r in reference["rows"]]
  assert len(losses) == TOTAL and all(np.isfinite(losses))
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  assert last < first - 0.5, (first, last)  # from about ln(300) = 5.7
  assert reference["final"]["step"] == TOTAL and reference["final"]["loss"] == losses[-1]


def test_restarting_a_finished_run_trains_nothing(reference, tmp_path):
  """A restart of a run that has done all its steps restores, trains nothing, leaves the log as it
  was, and returns the last logged metrics (not an empty row)."""
  workdir = tmp_path / "done"
  shutil.copytree(reference["workdir"], workdir)
  again = loop.run(reference["config"], str(workdir))
  assert again["step"] == TOTAL and again["loss"] == reference["final"]["loss"]
  assert read_rows(workdir) == reference["rows"]


def test_metrics_log_and_tensorboard(reference):
  rows, config = reference["rows"], reference["config"]
  assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
  schedule = learning_rate_schedule(config.optim, TOTAL)
  for r in rows:
    for k in ("loss", "grad_norm", "lr", "moe/maxvio_batch", "bad_steps"):
      assert k in r and np.isfinite(r[k]), (r["step"], k)
    assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-6)
    assert r["finite"] == 1.0 and r["bad_steps"] == 0
    # With log_every=1 every step but the compiling ones is timed (tests/training/test_throughput.py).
    assert ("tokens_per_s" in r) == (r["step"] not in COMPILE_STEPS), r["step"]
    assert r.get("tokens_per_s", 1.0) > 0
    for layer in MOE_LAYERS:
      name = f"moe/{layer}/moe"
      assert 0 <= r[f"{name}/maxvio_batch"] and 0.5 <= r[f"{name}/top_share"] <= 1.0
      assert r[f"{name}/load_min"] <= 1.0 <= r[f"{name}/load_max"]
      load = np.asarray(r[f"{name}/load"])  # per expert, over the mean: logged every log_every steps
      assert load.shape == (4,) and np.mean(load) == pytest.approx(1.0, rel=1e-5)
      assert (load.min(), load.max()) == pytest.approx((r[f"{name}/load_min"], r[f"{name}/load_max"]))
  assert [r["step"] for r in rows if "val_loss" in r] == [10, 20]
  assert all(np.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)

  scalars, histograms = {}, {}
  for name in os.listdir(os.path.join(reference["workdir"], "tb")):
    for event in _read_events(os.path.join(reference["workdir"], "tb", name)):
      for v in event.summary.value:
        if v.HasField("histo"):
          histograms.setdefault(v.tag, {})[event.step] = v.histo
        else:
          scalars.setdefault(v.tag, {})[event.step] = v.simple_value
  moe_tags = [f"moe/{layer}/moe/{m}" for layer in MOE_LAYERS
              for m in ("maxvio_batch", "top_share", "load_max")]
  for tag in ("loss", "lr", "grad_norm", *moe_tags):
    assert sorted(scalars[tag]) == list(range(1, TOTAL + 1)), tag
  assert sorted(scalars["tokens_per_s"]) == [s for s in range(1, TOTAL + 1) if s not in COMPILE_STEPS]
  assert sorted(scalars["val_loss"]) == [10, 20]
  for layer in MOE_LAYERS:  # the per-expert load, one histogram per layer and step
    histos = histograms[f"moe/{layer}/moe/load"]
    assert sorted(histos) == list(range(1, TOTAL + 1))
    for r in rows:
      h, load = histos[r["step"]], r[f"moe/{layer}/moe/load"]
      assert h.num == 4 and h.sum == pytest.approx(sum(load), rel=1e-5)
      assert (h.min, h.max) == pytest.approx((min(load), max(load)), rel=1e-5)
  np.testing.assert_allclose([scalars["loss"][s] for s in range(1, TOTAL + 1)],
                             [r["loss"] for r in rows], rtol=1e-6)


def _read_events(path):
  """TFRecord framing: length u64, its crc u32, the Event proto, its crc u32."""
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (n,) = struct.unpack("<Q", data[pos:pos + 8])
    yield event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
    pos += 12 + n + 4


def test_stage_switch_carries_the_state(reference):
  rows = reference["rows"]
  assert reference["shapes"] == [(8, 64)] * 20 + [(4, 128)] * 8
  assert [r["seq_len"] for r in rows] == [64] * 20 + [128] * 8
  assert [r["stage"] for r in rows] == [0] * 20 + [1] * 8
  assert all(r["tokens"] == 512 for r in rows)
  states = {s: restore_state(reference["config"], reference["workdir"], s) for s in (10, 20, TOTAL)}
  for s, state in states.items():
    assert int(state.step) == s
    counts = [int(v) for path, v in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
              if "count" in jax.tree_util.keystr(path)]
    assert counts and all(c == s for c in counts), counts  # no update was lost or repeated
    # Every step routes each of the 512 tokens to top_k=2 experts; the totals are never reset.
    for layer in MOE_LAYERS:
      assert float(np.sum(state.balance[layer]["moe"]["load_total"])) == s * 512 * 2


def count_fresh_states(monkeypatch) -> list:
  """The fresh states `loop.run` draws from here on: one entry each."""
  drawn, plan = [], loop.sharded_state_plan

  def counted(*args, **kwargs):
    template, draw, optimizer, shardings = plan(*args, **kwargs)
    return template, lambda rng: drawn.append(rng) or draw(rng), optimizer, shardings

  monkeypatch.setattr(loop, "sharded_state_plan", counted)
  return drawn


def test_restart_at_the_stage_boundary_and_after_a_time_limit_equals_one_process(reference, tmp_path, caplog,
                                                                                  monkeypatch):
  """Checkpoint 20 ends stage 0; restarting there must pick up stage 1's stream where the
  uninterrupted run did. On the way the run stops at its time limit (at the first logged step past
  it, 21), saves there, and the same command resumes it. Neither resume draws a fresh state: the
  checkpoint restores into the state's shapes (a drawn state's freed buffers would split the device's
  memory)."""
  drawn = count_fresh_states(monkeypatch)
  copy_checkpoints(reference["workdir"], tmp_path, [20])
  limited = make_config(reference["config"].data.cache_dir, **{"train.time_limit_s": 1e-9})
  with caplog.at_level(logging.WARNING, logger="moejax.train"):
    stopped = loop.run(limited, str(tmp_path))
  assert stopped["step"] == 21 and "train.time_limit_s=1e-09 reached" in caplog.text, caplog.text
  assert ckpt_lib.Manager(str(tmp_path / "checkpoints"), 5).all_steps() == [20, 21]
  loop.run(reference["config"], str(tmp_path))
  assert_same_rows(read_rows(tmp_path), reference["rows"][20:])
  assert_same_params(restore_state(reference["config"], tmp_path, TOTAL).params,
                     restore_state(reference["config"], reference["workdir"], TOTAL).params)
  assert drawn == []


def test_every_stage_boundary_is_checkpointed(reference, tmp_path, monkeypatch):
  """With checkpoint_every past the run's end, the saves are the stage boundary and the last step. A
  fresh run draws its state once."""
  drawn = count_fresh_states(monkeypatch)
  config = make_config(reference["config"].data.cache_dir, **{
      "train.stages": ((64, 3, 512), (128, 2, 512)), "train.checkpoint_every": 100, "train.eval_every": 0})
  loop.run(config, str(tmp_path))
  assert ckpt_lib.Manager(str(tmp_path / "checkpoints"), 5).all_steps() == [3, 5]
  assert len(drawn) == 1


def test_resuming_on_other_data_is_refused(reference, tmp_path):
  """A resume records what it trains on; the same checkpoint on another corpus (here a smaller cap,
  which changes the content and retrains the tokenizer) stops before any step."""
  copy_checkpoints(reference["workdir"], tmp_path, [20])
  config = reference["config"]
  manifest_path = loop.prepare(config.data)  # pinned as the run's first start would have
  pin = run_files.data_pin(manifest_path, loop.load_manifest(manifest_path), config.data)
  run_files.write_json(str(tmp_path / "data.json"), pin)
  other = make_config(config.data.cache_dir, **{"data.max_bytes": 200_000})
  with pytest.raises(ConfigError, match="trained on other data"):
    loop.run(other, str(tmp_path))
  assert ckpt_lib.Manager(str(tmp_path / "checkpoints"), 5).all_steps() == [20]


def test_resuming_on_other_data_streams_is_refused_and_keeps_the_checkpoints(reference, tmp_path):
  """The run's streams are pinned (one, the process count of its start): another count would index
  other data. Refused before anything is restored, and the checkpoint stays where it was."""
  copy_checkpoints(reference["workdir"], tmp_path, [20])
  shutil.copy(os.path.join(reference["workdir"], "run.json"), tmp_path / "run.json")
  streams = make_config(reference["config"].data.cache_dir, **{"data.streams": 2})
  with pytest.raises(ConfigError, match=r"data.streams: 1 -> 2"):
    loop.run(streams, str(tmp_path))
  assert ckpt_lib.Manager(str(tmp_path / "checkpoints"), 5).all_steps() == [20]
  assert not (tmp_path / "checkpoints.unreadable").exists()


def test_data_seed_orders_the_data_and_train_seed_does_not(reference):
  config = reference["config"]
  first = lambda c: _digest(next(iterator_for_step(c, 0)))
  base = first(config)
  assert first(make_config(config.data.cache_dir, **{"train.seed": 7})) == base
  assert first(make_config(config.data.cache_dir, **{"data.seed": 7})) != base


def _damage(step_dir, how):
  """"corrupt": garbage over the start of every array data file; "partial": the data files gone."""
  data_dir = step_dir / "state" / "ocdbt.process_0"
  if how == "corrupt":
    for root, _, files in os.walk(data_dir / "d"):
      for name in files:
        with open(os.path.join(root, name), "r+b") as f:
          f.write(b"\0garbage" * 16)
  else:
    shutil.rmtree(data_dir)


@pytest.mark.parametrize("how", ["corrupt", "partial"])
def test_unreadable_newest_checkpoint_falls_back(reference, tmp_path, caplog, how):
  """What `run` does on restart, without the training: the newest checkpoint is damaged, restore
  warns and returns the previous one, and that step can be saved again."""
  config = reference["config"]
  copy_checkpoints(reference["workdir"], tmp_path, [20, TOTAL])
  _damage(tmp_path / "checkpoints" / str(TOTAL), how)
  template, _, _ = init_state(build_model(config), config, jax.random.key(1), TOTAL)
  manager = ckpt_lib.Manager(str(tmp_path / "checkpoints"), 5)
  stages = [tuple(s) for s in STAGES]
  with caplog.at_level(logging.WARNING, logger="moejax.training.checkpoint"):
    state, data_it = manager.restore_latest(template, lambda s: iterator_for_step(config, s, stages))
  assert f"checkpoint at step {TOTAL} is unreadable" in caplog.text
  assert int(state.step) == 20
  assert_same_params(jax.device_get(state.params), restore_state(config, reference["workdir"], 20).params)
  # The stream continues with the batch the uninterrupted run took for step 21.
  assert _digest(next(data_it)) == reference["digests"][20]
  # The damaged step was moved aside, so the resumed run can save that step again.
  assert manager.all_steps() == [20]
  assert os.listdir(tmp_path / "checkpoints.unreadable")[0].startswith(f"{TOTAL}-")
  manager.save(TOTAL, state, data_it)
  manager.wait()
  assert manager.all_steps() == [20, TOTAL]


def test_nan_guard_skips_counts_and_stops(reference, tmp_path, monkeypatch, caplog):
  """From checkpoint 10: two good steps, then every loss is NaN; max_bad_steps=3 stops at 15."""
  copy_checkpoints(reference["workdir"], tmp_path, [10])

  def poison_from_third(i, batch):
    if i >= 2:
      batch = dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.nan))
    return batch

  _tap_iterators(monkeypatch, poison_from_third)
  config = make_config(reference["config"].data.cache_dir, **{"train.max_bad_steps": 3,
                                                              "train.checkpoint_every": 1})
  with caplog.at_level(logging.WARNING), pytest.raises(FloatingPointError) as err:
    loop.run(config, str(tmp_path))
  msg = str(err.value)
  assert "3 consecutive non-finite steps up to step 15" in msg and "last good checkpoint is step 12" in msg
  assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints")) == [10, 11, 12]
  rows = read_rows(tmp_path)
  assert [r["step"] for r in rows] == [11, 12, 13, 14, 15]
  assert [r["finite"] for r in rows] == [1, 1, 0, 0, 0]
  assert [r["bad_steps"] for r in rows] == [0, 0, 1, 2, 3]
  # The logged rate is the one each update used: a skipped step does not advance the schedule.
  schedule = learning_rate_schedule(config.optim, TOTAL)
  assert [r["lr"] for r in rows] == pytest.approx([float(schedule(n)) for n in (10, 11, 12, 12, 12)])
  assert_same_rows(rows[:2], reference["rows"][10:12])
  assert caplog.text.count("update skipped") == 3


def test_skipped_step_leaves_the_state_unchanged(reference):
  config = reference["config"]
  model = build_model(config)
  state, optimizer, _ = init_state(model, config, jax.random.key(0), TOTAL)
  batch = next(iterator_for_step(config, 0))
  step = loop.jit_train_step(model, optimizer, config, TOTAL)
  state, _ = step(state, batch)  # one good step, so the optimizer state is not all zeros
  before = jax.device_get(state)
  bad = dict(batch, loss_mask=np.where(np.arange(64) == 7, np.nan, batch["loss_mask"]).astype(np.float32))
  state, m = step(state, bad)
  assert not bool(m["finite"]) and int(m["bad_steps"]) == 1
  after = jax.device_get(state)
  assert int(after.step) == int(before.step) + 1 and int(after.bad_steps) == 1
  for name in ("params", "opt_state", "balance"):
    assert_same_params(getattr(after, name), getattr(before, name))
  state, m = step(state, batch)
  assert bool(m["finite"]) and int(m["bad_steps"]) == 0 and int(state.bad_steps) == 0


def test_kill_and_resume_is_bit_exact(reference, tmp_path, caplog, compilation_cache_dir):
  """`python -m moejax.train` gets SIGKILL as soon as its checkpoint of step 10 is complete; a
  fresh `run` on the same workdir resumes there and reproduces the uninterrupted run bit for bit:
  every logged metric of every step (the killed process's steps included) and the final
  parameters. The metrics log holds each step once: the killed run's tail is dropped on resume."""
  config_file = runs.write_config_file(tmp_path / "config.py", {
      **OVERRIDES, "data.cache_dir": str(reference["config"].data.cache_dir)})
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(jax.device_count()),
             JAX_COMPILATION_CACHE_DIR=compilation_cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  with open(tmp_path / "stderr.txt", "w") as err:
    proc = subprocess.Popen([sys.executable, "-m", "moejax.train", f"--config={config_file}",
                             f"--workdir={workdir}"], env=env, stdout=subprocess.DEVNULL, stderr=err)
    alive = runs.kill_when(proc, (workdir / "checkpoints" / "10").exists)
  assert alive, f"the run ended before it was killed:\n{(tmp_path / 'stderr.txt').read_text()[-3000:]}"
  killed_at = _last_logged_step(workdir)
  assert proc.returncode == -signal.SIGKILL and 10 <= killed_at < 20
  with caplog.at_level(logging.INFO, logger="moejax.train"):
    loop.run(reference["config"], str(workdir))
  assert "resumed from step 10" in caplog.text
  assert_same_rows(read_rows(workdir), reference["rows"])
  assert_same_params(restore_state(reference["config"], workdir, TOTAL).params,
                     restore_state(reference["config"], reference["workdir"], TOTAL).params)


def _last_logged_step(workdir) -> int:
  try:
    with open(workdir / "metrics.jsonl") as f:
      steps = [json.loads(line)["step"] for line in f if line.endswith("\n")]
  except FileNotFoundError:
    return 0
  return max(steps, default=0)


def _row(step, *maxvios):
  return {"loss": 1.0, **{f"moe/layer_{i}/moe/maxvio_batch": v for i, v in enumerate(maxvios)},
          "moe/maxvio_batch": float(np.mean(maxvios))}


def test_maxvio_alert_fires_only_when_maxvio_stays_high(tmp_path, caplog):
  config = base_config()
  config.train.update(maxvio_alert=1.0, maxvio_alert_steps=3, progress_bar=False)
  monitor = Monitor(str(tmp_path), config, total_steps=20)
  # Layer 1 alone collapses: the mean over layers (0.8) never crosses the threshold.
  maxvio_1 = [1.5, 1.5, 0.2, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 0.1]
  with caplog.at_level(logging.WARNING, logger="moejax.training.monitor"):
    for step, v in enumerate(maxvio_1, start=1):
      monitor.record(step, _row(step, 0.1, v))
  monitor.close()
  alerts = [r.getMessage() for r in caplog.records if "expert-collapse" in r.getMessage()]
  # Streaks: steps 1-2 (too short), 4-9 (alerts after 3 and 6 steps: at steps 6 and 9).
  assert len(alerts) == 2 and monitor.alerts == 2
  assert "at step 6" in alerts[0] and "at step 9" in alerts[1] and "layer_1" in alerts[0]


def test_monitor_drops_a_killed_runs_tail_on_resume(tmp_path):
  config = base_config()
  config.train.progress_bar = False
  monitor = Monitor(str(tmp_path), config, total_steps=10)
  for step in range(1, 8):
    monitor.record(step, {"step": step, "loss": float(step)})
  monitor.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "lo')  # cut off by the kill
  Monitor(str(tmp_path), config, total_steps=10, start_step=5).close()
  assert [r["step"] for r in read_rows(tmp_path)] == [1, 2, 3, 4, 5]


def test_monitor_flush_and_an_unterminated_last_row(tmp_path):
  """flush (called before each checkpoint) writes out rows between logging steps; a row the kill left
  without its newline is kept on resume and the next row starts a line of its own."""
  config = base_config()
  config.train.update(progress_bar=False, log_every=10)
  monitor = Monitor(str(tmp_path), config, total_steps=10)
  for step in range(1, 4):
    monitor.record(step, {"step": step, "loss": float(step)})
  monitor.flush()
  assert [r["step"] for r in read_rows(tmp_path)] == [1, 2, 3]
  monitor.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "loss": 4.0}')  # killed before the newline
  monitor = Monitor(str(tmp_path), config, total_steps=10, start_step=4)
  monitor.record(5, {"step": 5, "loss": 5.0})
  monitor.close()
  assert [r["step"] for r in read_rows(tmp_path)] == [1, 2, 3, 4, 5]


def test_monitor_logs_load_vectors_only_at_logging_steps(tmp_path):
  config = base_config()
  config.train.update(progress_bar=False, log_every=3)
  monitor = Monitor(str(tmp_path), config, total_steps=6)
  for step in range(1, 7):
    monitor.record(step, {"step": step, "loss": 1.0, "moe/layer_0/moe/load": [0.5, 1.5, 1.0, 1.0]})
  monitor.close()
  rows = read_rows(tmp_path)
  assert [r["step"] for r in rows] == list(range(1, 7))
  assert [s for s, r in enumerate(rows, start=1) if "moe/layer_0/moe/load" in r] == [3, 6]
  assert rows[2]["moe/layer_0/moe/load"] == [0.5, 1.5, 1.0, 1.0]
  histograms = [(e.step, v.histo.num) for name in os.listdir(tmp_path / "tb")
                for e in _read_events(os.path.join(tmp_path, "tb", name))
                for v in e.summary.value if v.HasField("histo")]
  assert histograms == [(3, 4), (6, 4)]


def test_cli_without_flags_prints_usage():
  out = subprocess.run([sys.executable, "-m", "moejax.train"], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert out.returncode != 0
  assert "usage: python -m moejax.train --config" in out.stderr and "--workdir" in out.stderr


def test_all_checkpoints_unreadable_is_an_error(reference, tmp_path):
  """With nothing readable to fall back to, the run stops instead of silently starting over."""
  copy_checkpoints(reference["workdir"], tmp_path, [10])
  _damage(tmp_path / "checkpoints" / "10", "partial")
  with pytest.raises(RuntimeError, match=r"none of the checkpoints \[10\]"):
    loop.run(reference["config"], str(tmp_path))
  assert os.path.isdir(tmp_path / "checkpoints" / "10")


def test_run_in_passes_follows_the_one_pass_run(reference, tmp_path, monkeypatch):
  """`run` with train.microbatch_tokens: 8 rows a step in 2 passes of 4. Without a bias moving between
  passes (balance "none") the losses follow the one-pass run, and evaluation, which reads the
  validation split a pass at a time (twice as many batches of half the rows), gives its val_loss."""
  overrides = {"train.stages": ((64, 4, 512),), "train.checkpoint_every": 4, "train.eval_every": 2,
               "model.moe.balance": "none"}
  cache = reference["config"].data.cache_dir
  eval_rows = []
  make_dataset = loop.make_dataset

  def recording(manifest_path, split, **kwargs):
    if split == "validation":
      eval_rows.append(kwargs["batch_size"])
    return make_dataset(manifest_path, split, **kwargs)

  monkeypatch.setattr(loop, "make_dataset", recording)
  peak = 1e9  # as if the CPU were a card of this data-sheet peak: the rows then carry an MFU
  monkeypatch.setattr(loop, "spec_bf16_peak", lambda device_kind: peak)
  loop.run(make_config(cache, **overrides), str(tmp_path / "one"))
  loop.run(make_config(cache, **overrides, **{"train.microbatch_tokens": 256}), str(tmp_path / "passes"))
  assert eval_rows == [8, 8, 4, 4]
  one, passes = read_rows(tmp_path / "one"), read_rows(tmp_path / "passes")
  assert [r["step"] for r in passes] == [1, 2, 3, 4]
  for key in ("loss", "nll", "tokens", "grad_norm"):
    np.testing.assert_allclose([r[key] for r in passes], [r[key] for r in one], rtol=1e-4, err_msg=key)
  np.testing.assert_allclose([passes[i]["val_loss"] for i in (1, 3)], [one[i]["val_loss"] for i in (1, 3)],
                             rtol=1e-5)
  # MFU = tokens/s x model FLOPs per token / (peak x devices), the FLOPs between those of rows of
  # one-token documents and of one document a row (attention counted within documents).
  config = make_config(cache, **overrides)
  params = jax.eval_shape(lambda: init_state(build_model(config), config, jax.random.key(0), 4)[0].params)
  bound = lambda seg: model_flops_per_token(config, params, seg)["total"]
  low, high = bound(np.arange(64)[None]), bound(np.ones((1, 64), np.int32))
  measured = [r for r in one if "tokens_per_s" in r]
  assert measured and all("mfu" in r for r in measured)
  for r in measured:
    # A mesh of one device; rows of long documents come within float rounding of the upper bound.
    assert low * (1 - 1e-6) <= r["mfu"] * peak * 1 / r["tokens_per_s"] <= high * (1 + 1e-6)


def test_resume_keeps_the_data_stream_and_warns_of_another_schedule(tmp_path, caplog):
  """run.json: a resume may append stages, lengthen or cut the current one and change the schedule
  (with a warning), but not change the stages already run, the current stage's shape or the data
  order; a step that now falls in another stage than the saved run's starts that stage afresh."""
  config, workdir = base_config(), str(tmp_path)
  first = [(64, 10, 256), (128, 10, 256)]
  assert pin_run(workdir, config, first, None) is False  # a fresh start
  assert json.loads((tmp_path / "run.json").read_text())["stages"] == [[64, 10, 256], [128, 10, 256]]
  assert pin_run(workdir, config, first, 15) is False  # killed in stage 1, resumed as it was
  with caplog.at_level(logging.WARNING, logger="moejax.train"):
    assert pin_run(workdir, config, first + [(256, 5, 512)], 15) is False  # a stage appended
  assert "total_steps: 20 -> 25" in caplog.text
  pin_run(workdir, config, first, 15)
  # The run ended (step 20) and a stage was appended: step 20 starts it, afresh.
  assert pin_run(workdir, config, first + [(256, 5, 512)], 20) is True
  # Stage 1 cut short: step 15 now falls in stage 2.
  cut = [(64, 10, 256), (128, 3, 256), (256, 5, 512)]
  assert pin_run(workdir, config, cut, 15) is True
  for bad in ([(64, 8, 256), (128, 5, 256), (256, 5, 512)], [(64, 10, 256), (128, 3, 512), (256, 5, 512)]):
    with pytest.raises(ConfigError, match=r"train.stages: .*step 12 is in stage 1"):
      pin_run(workdir, config, bad, 12)
  config.data.seed = 3
  with pytest.raises(ConfigError, match=r"data.seed: 0 -> 3.*delete"):
    pin_run(workdir, config, cut, 12)
  config.data.seed = 0
  with pytest.raises(ConfigError, match=r"data.streams: 1 -> 2"):  # a data order of its own
    pin_run(workdir, config, cut, 12, streams=2)
  config.optim.lr = 1e-4
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="moejax.train"):
    assert pin_run(workdir, config, cut, 12) is False
  assert "optim.lr: 0.003 -> 0.0001" in caplog.text


def test_a_stage_appended_after_the_end_starts_its_stream_afresh(reference, tmp_path, caplog):
  """The finished reference run resumed with a third stage: its first batch is that stage's stream's
  first, not the saved position of stage 1's stream."""
  copy_checkpoints(reference["workdir"], tmp_path, [TOTAL])
  shutil.copy(os.path.join(reference["workdir"], "run.json"), tmp_path / "run.json")
  stages = tuple(reference["config"].train.stages) + ((128, 2, 512),)
  config = make_config(reference["config"].data.cache_dir, **{"train.stages": stages})
  first = next(loop._batch_iterator(config, stages[2], "train", config.data.seed + 2, prepare(config.data),
                                    1))
  seen = []
  with caplog.at_level(logging.INFO, logger="moejax.train"):
    with pytest.MonkeyPatch.context() as mp:
      _tap_iterators(mp, lambda i, batch: seen.append(batch) or batch)
      loop.run(config, str(tmp_path))
  np.testing.assert_array_equal(seen[0]["tokens"], first["tokens"])
  assert "its stream starts afresh" in caplog.text and "total_steps: 28 -> 30" in caplog.text
  assert [r["step"] for r in read_rows(tmp_path)][-2:] == [29, 30]


@pytest.mark.parametrize("balance", ["none", "quantile"])
def test_a_collapsing_run_raises_the_collapse_alert(balance, shared, tmp_path, caplog):
  """Every token starts routed to the same two of four experts (moe.initial_bias 1 outweighs any
  difference of sigmoid scores). Without balancing they stay there (MaxVio_batch 1: two experts at twice
  their share) and the run's expert-collapse alert fires; quantile balancing undoes the skew within two
  steps, and no alert fires."""
  config = make_config(shared / "data", **{
      "model.moe.balance": balance, "model.moe.initial_bias": 1.0, "train.stages": ((64, 6, 256),),
      "train.maxvio_alert": 0.5, "train.maxvio_alert_steps": 3, "train.log_every": 1,
      "train.eval_every": 0, "train.checkpoint_every": 6})
  with caplog.at_level(logging.WARNING, logger="moejax.training.monitor"):
    loop.run(config, str(tmp_path / "run"))
  alerts = [r.getMessage() for r in caplog.records if "expert-collapse alert" in r.getMessage()]
  rows = runs.read_rows(tmp_path / "run" / "metrics.jsonl")
  worst = [max(v for k, v in r.items() if k.endswith("/moe/maxvio_batch") and k.startswith("moe/layer_"))
           for r in rows]
  if balance == "none":
    assert worst == [1.0] * 6 and len(alerts) == 2, (worst, alerts)  # at steps 3 and 6
  else:
    # The bias solved on batch 1 routes batch 2 (0.55 there: other tokens), and holds from then on.
    assert worst[0] == 1.0 and max(worst[2:]) < 0.5 and not alerts, (worst, alerts)
