"""The training loop that `python -m moejax.train` runs.

Runs the progressive-context stages of `config.train.stages` in order inside one process, checkpoints
the whole train state and the data iterator, and resumes from the newest readable checkpoint in
`--workdir` when restarted.
"""

import hashlib
import json
import logging
import os
import shutil
import time

import jax
import numpy as np

from moejax.config import passes_per_step
from moejax.data import load_manifest, make_iterator
from moejax.data.prepare import prepare
from moejax.device_memory import DeviceOutOfMemoryError, is_out_of_memory, out_of_memory_message
from moejax.errors import ConfigError
from moejax.model import build_model
from moejax.parallel.mesh import MESH_AXES, batch_sharding, make_mesh
from moejax.training import checkpoint as ckpt_lib
from moejax.training.monitor import Monitor, resolve_workdir, summary, to_row
from moejax.training.state import init_state, state_shardings
from moejax.training.step import jit_eval_step, jit_train_step
from moejax.vision.pipeline import make_vision_dataset

log = logging.getLogger("moejax.train")


def stage_at(stages, step: int):
  """(stage index, first step of that stage) for a global step; past the end -> the last stage."""
  start = 0
  for i, (_, steps, _) in enumerate(stages):
    if step < start + steps:
      return i, start
    start += steps
  return len(stages) - 1, start - stages[-1][1]


def _batch_iterator(config, stage, split, seed, manifest_path=None):
  seq_len, _, tokens = stage
  if config.model.vision.enabled:  # rows of images and text (moejax.vision.pipeline)
    rows, processes = tokens // seq_len, jax.process_count()
    if rows % processes:
      raise ConfigError(f"a batch of {rows} rows does not split over {processes} processes")
    return iter(make_vision_dataset(config, manifest_path or prepare(config.data), split, seq_len=seq_len,
                                    batch_size=rows // processes, seed=seed,
                                    shard_index=jax.process_index(), shard_count=processes))
  return make_iterator(config.data, split, seq_len, tokens // seq_len, seed, manifest_path=manifest_path)


def _pin_data(workdir: str, manifest_path: str, manifest: dict, resuming: bool) -> None:
  """Records the corpus content and tokenizer that the run trains on (workdir/data.json); a resume on
  other data (a corpus edited since, another tokenizer) is refused: the weights would read token ids
  with other meanings, and the saved data position would index another dataset."""
  tokenizer_file = os.path.join(os.path.dirname(manifest_path), manifest["tokenizer"]["file"])
  with open(tokenizer_file, "rb") as f:
    tokenizer_sha256 = hashlib.sha256(f.read()).hexdigest()
  pin = {"content_sha256": manifest["content_sha256"], "tokenizer_sha256": tokenizer_sha256}
  path = os.path.join(workdir, "data.json")
  if resuming and os.path.exists(path):
    with open(path) as f:
      trained_on = json.load(f)
    if trained_on != pin:
      raise ConfigError(f"the checkpoints in {workdir} were trained on other data ({path}: {trained_on}) "
                        f"than {manifest_path} holds now ({pin}): restore the corpus and data config, or "
                        f"start in a new workdir")
  _write_json(path, pin)


# What moejax.inference.load_model reads from a workdir besides the checkpoints.
CONFIG_FILE, TOKENIZER_FILE = "config.json", "tokenizer.json"


def _save_for_inference(workdir: str, config, manifest_path: str, manifest: dict) -> None:
  """The run's validated config and its tokenizer, next to the checkpoints: a workdir alone is enough to
  load the model and generate (moejax.inference.load_model), wherever the prepared corpus lives."""
  _write_json(os.path.join(workdir, CONFIG_FILE), config.to_dict())
  source = os.path.join(os.path.dirname(manifest_path), manifest["tokenizer"]["file"])
  shutil.copyfile(source, os.path.join(workdir, TOKENIZER_FILE + ".tmp"))
  os.replace(os.path.join(workdir, TOKENIZER_FILE + ".tmp"), os.path.join(workdir, TOKENIZER_FILE))


def _write_json(path: str, value) -> None:
  """Written whole or not at all: a kill mid-write leaves the old file."""
  with open(path + ".tmp", "w") as f:
    json.dump(value, f)
  os.replace(path + ".tmp", path)


# Settings that order the data stream: a checkpoint's saved data position indexes the stream they made.
_STREAM_FIELDS = ("data.seed", "data.shuffle_buffer", "data.valid_fraction")
# Settings of the learning-rate schedule, which is rebuilt from the config on every start.
_SCHEDULE_FIELDS = ("optim.lr", "optim.adam_lr", "optim.warmup_steps", "optim.final_lr_fraction")


def _pin_run(workdir: str, config, stages, step: int | None) -> bool:
  """Records the stages and the settings a resume must keep (workdir/run.json), checks a resume from
  `step` (None: a fresh start) against them, and says whether the resumed step's data stream must
  start afresh rather than from the checkpoint's saved position.

  Refused, with ConfigError: other stages before the one the saved run was in at `step`, another
  sequence length or batch for that one (its saved data position indexes that stream), or another
  data order (`_STREAM_FIELDS`). Allowed: stages appended, the current one lengthened or shortened,
  other schedule settings, with a warning where the learning-rate schedule changes (it is rebuilt for
  the new total, so the rate from this step on is not the one the earlier run planned). Where the
  step now falls in another stage than the saved run's (a stage appended after the run ended, or the
  current one cut short), that stage's stream starts from its beginning (returns True)."""
  path = os.path.join(workdir, "run.json")
  get = lambda name: config[name.split(".")[0]][name.split(".")[1]]
  pin = {"stages": [list(s) for s in stages], "total_steps": sum(s[1] for s in stages),
         **{name: get(name) for name in _STREAM_FIELDS + _SCHEDULE_FIELDS}}
  fresh = False
  if step is not None and os.path.exists(path):
    with open(path) as f:
      before = json.load(f)
    old_stages = [tuple(s) for s in before["stages"]]
    i, _ = stage_at(old_stages, step)
    kept = (len(stages) > i and old_stages[:i] == list(stages[:i])
            and (stages[i][0], stages[i][2]) == (old_stages[i][0], old_stages[i][2]))
    differences = lambda names: [f"{name}: {before.get(name)!r} -> {pin[name]!r}" for name in names
                                 if before.get(name) != pin[name]]
    changed = differences(_STREAM_FIELDS)
    if not kept:
      changed.insert(0, f"train.stages: {before['stages']} -> {pin['stages']} (step {step} is in stage "
                        f"{i} of the saved run: the stages before it, its sequence length and its batch "
                        f"must stay)")
    if changed:
      raise ConfigError(f"the checkpoints in {workdir} (step {step}) were made by a run whose data stream "
                        f"this config changes: {'; '.join(changed)}. Restore those settings, start in a new "
                        f"workdir, or delete {path} to resume on the new stream all the same")
    if moved := differences(("total_steps",) + _SCHEDULE_FIELDS):
      log.warning("resuming at step %d with another learning-rate schedule (%s): it is rebuilt for the new "
                  "settings, so the rate from here on is not the one the earlier run planned", step,
                  "; ".join(moved))
    fresh = stage_at(stages, step)[0] != i
  _write_json(path, pin)
  return fresh


def evaluate(eval_step, state, config, stage, to_device=lambda batch: batch, manifest_path=None) -> dict:
  """Validation loss over config.train.eval_batches batches of the stage's size, each taken in the
  train step's passes (train.microbatch_tokens): the forward never holds more than a pass."""
  seq_len, steps, tokens = stage
  passes = passes_per_step(seq_len, tokens, config.train.microbatch_tokens)
  it = iter(_batch_iterator(config, (seq_len, steps, tokens // passes), "validation", config.data.seed,
                            manifest_path))
  total, count = 0.0, 0.0
  for _ in range(config.train.eval_batches * passes):
    m = eval_step(state, to_device(next(it)))
    total += float(m["nll"]) * float(m["tokens"])
    count += float(m["tokens"])
  return {"val_loss": total / max(count, 1.0)}


def run(config, workdir: str) -> dict:
  """Trains to the end of the last stage; returns the final metrics row.

  `workdir` may be relative (to the current directory) or a URL (gs://, ...), which is kept as given."""
  workdir = resolve_workdir(workdir)
  model = build_model(config)  # validates the config first
  os.makedirs(workdir, exist_ok=True)
  # Prepared once: every stream of the run reads these shards, even if the corpus changes meanwhile.
  manifest_path = prepare(config.data)
  manifest = load_manifest(manifest_path)
  tokenizer_vocab = manifest["tokenizer"]["vocab_size"]
  if config.model.vocab_size < tokenizer_vocab:
    raise ConfigError(f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
                      f"{tokenizer_vocab} ids")
  stages = [tuple(s) for s in config.train.stages]
  total_steps = sum(s[1] for s in stages)

  mesh = make_mesh(**config.train.mesh, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
  if mesh.size < jax.device_count():
    log.warning("train.mesh %s uses %d of the %d devices; the others stay idle", dict(config.train.mesh),
                mesh.size, jax.device_count())
  state, optimizer, axes = init_state(model, config, jax.random.key(config.train.seed), total_steps)
  shardings = state_shardings(state, axes, mesh)
  state = jax.device_put(state, shardings)  # a restore comes back in the same placement
  rows = batch_sharding(mesh)
  to_device = lambda batch: jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows, x), batch)
  manager = ckpt_lib.Manager(os.path.join(workdir, "checkpoints"), config.train.keep_checkpoints)
  data_it = _iterator_for_step(config, stages, 0, manifest_path)
  restored = manager.restore_latest(state, lambda s: _iterator_for_step(config, stages, s, manifest_path))
  _pin_data(workdir, manifest_path, manifest, resuming=restored is not None)
  _save_for_inference(workdir, config, manifest_path, manifest)
  fresh_stream = _pin_run(workdir, config, stages, None if restored is None else int(restored[0].step))
  if restored is not None:
    state, data_it = restored
    log.info("resumed from step %d", int(state.step))
    if fresh_stream:
      data_it = _iterator_for_step(config, stages, int(state.step), manifest_path)
      log.info("step %d is in stage %d, where the saved run was not at this step: its stream starts afresh",
               int(state.step), stage_at(stages, int(state.step))[0])

  train_step = jit_train_step(model, optimizer, config, total_steps, shardings)
  eval_step = jit_eval_step(model, config)
  monitor = Monitor(workdir, config, total_steps, start_step=int(state.step))
  step = int(state.step)
  stage_idx, _ = stage_at(stages, step)
  save_due = False
  # Most steps' metrics are read after the next step is dispatched, so the host does not wait for the
  # device between steps (the NaN guard may therefore stop the run one step after it trips). The steps
  # where the run measures its throughput (logging, evaluation, checkpoint and compile steps) are read
  # right after their own dispatch instead, before the next one: where dispatch blocks until the step
  # is nearly done (a big GPU step fills the launch queue), a late read would time the wrong interval.
  pending = None
  # The throughput window: the tokens of the steps since the last measured step, and when that step
  # was read (None until a step past the compiles has been read). Compiles, evaluations and saves are
  # left out of it; `trained` adds up the windows for the closing summary.
  window = {"start": None, "tokens": 0.0}
  trained = {"steps": 0, "tokens": 0.0, "seconds": 0.0}
  row = {}
  running = ["the train step"]  # what an out-of-memory error is reported in

  def finish(done, measure=False, compiled_since=None, eval_state=None) -> dict:
    """Reads the metrics of `done` = (step, metrics on device, extras), adds the validation loss of
    `eval_state` if given, logs them, and stops the run after too many non-finite steps.

    `measure`: the step was read right after its dispatch, so the window ends here and the row gets
    its tokens_per_s. `compiled_since`: the step compiled its program, dispatched at this time; the
    window starts after it instead."""
    step_done, metrics, extra = done
    row = to_row(jax.device_get(metrics))
    now = time.perf_counter()
    tokens = extra.pop("tokens")
    row.update(step=step_done, **extra)
    trained["steps"] += 1
    if compiled_since is not None:
      log.info("step %d: %.1f s with the compile", step_done, now - compiled_since)
      window.update(start=now, tokens=0.0)
    else:
      window["tokens"] += tokens
      if measure and window["start"] is not None and now > window["start"]:
        seconds = now - window["start"]
        row["tokens_per_s"] = window["tokens"] / seconds
        trained["tokens"] += window["tokens"]
        trained["seconds"] += seconds
        window.update(start=now, tokens=0.0)
    if eval_state is not None:
      running[0] = f"evaluation at step {step_done}"
      row.update(evaluate(eval_step, eval_state, config, stages[row["stage"]], to_device, manifest_path))
      log.info("step %d: validation loss %.4f (train loss %.4f)", step_done, row["val_loss"], row["loss"])
      running[0] = "the train step"
      if window["start"] is not None:
        window["start"] = time.perf_counter()  # evaluation time is not training throughput
    monitor.record(step_done, row)
    if row["bad_steps"] >= config.train.max_bad_steps:
      last = manager.latest_step()
      where = (f"the last good checkpoint is step {last} in {manager.directory}" if last is not None
               else "no checkpoint was written before them")
      raise FloatingPointError(f"{int(row['bad_steps'])} consecutive non-finite steps up to step "
                               f"{step_done} (train.max_bad_steps={config.train.max_bad_steps}): "
                               f"stopping; {where}")
    return row

  if step >= total_steps:
    log.info("the run in %s has already trained its %d steps; its last logged metrics follow", workdir,
             total_steps)
    row = monitor.last_logged
  compiled = set()  # the stages whose step this process has compiled
  try:
    with jax.set_mesh(mesh):  # the steps, evaluation and saves all run on the run's mesh
      while step < total_steps:
        batch = next(data_it)
        compiles = stage_idx not in compiled
        compiled.add(stage_idx)
        if compiles:
          log.info("compiling the train step for stage %d (seq_len %d, %d tokens a step)", stage_idx,
                   *stages[stage_idx][::2])
        dispatched = time.perf_counter()
        state, m = train_step(state, to_device(batch))
        step += 1
        extra = {"stage": stage_idx, "seq_len": stages[stage_idx][0],
                 "tokens": float(np.sum(batch["loss_mask"] > 0))}  # real tokens, not padding
        if pending is not None:
          row, pending = finish(pending), None
        evaluate_now = bool(config.train.eval_every) and step % config.train.eval_every == 0
        new_stage, _ = stage_at(stages, step)
        switched = new_stage != stage_idx
        # Every stage boundary is saved too: the next stage's first step compiles anew and may not fit,
        # and a restart there should not repeat the end of the stage before.
        save_due = (save_due or switched or step % config.train.checkpoint_every == 0
                    or step == total_steps)
        # A checkpoint's step is logged before it is saved.
        if compiles or evaluate_now or save_due or step % config.train.log_every == 0:
          row = finish((step, m, extra), measure=True, compiled_since=dispatched if compiles else None,
                       eval_state=state if evaluate_now else None)
        else:
          pending = (step, m, extra)
        # Switch streams before saving: a checkpoint at a stage boundary then holds the new stage's
        # fresh iterator, which is the one a restart at that step builds and loads it into.
        if switched:
          # A new context length: same state, new data stream; the step retraces for the new shape.
          stage_idx = new_stage
          data_it = _iterator_for_step(config, stages, step, manifest_path)
          log.info("stage %d: seq_len=%d", stage_idx, stages[stage_idx][0])
        # A state that just skipped an update is not saved: the newest checkpoint stays a good one.
        if save_due and int(state.bad_steps) == 0:
          started = time.perf_counter()
          monitor.flush()  # the steps up to a checkpoint are never recorded again after a resume from it
          manager.save(step, state, data_it)
          log.info("step %d: checkpoint to %s (written in the background)", step,
                   os.path.join(manager.directory, str(step)))
          if window["start"] is not None:
            window["start"] += time.perf_counter() - started  # nor is saving
          save_due = False
      if pending is not None:
        row = finish(pending)
      if save_due:
        log.warning("the run ended on skipped (non-finite) steps, so its final state was not saved; the "
                    "newest checkpoint is step %s", manager.latest_step())
  except Exception as e:
    # XLA reports it where the step's memory is allocated: at its dispatch, or at the first read of its
    # results when dispatch is asynchronous.
    if is_out_of_memory(e):
      raise DeviceOutOfMemoryError(out_of_memory_message(config, stages[stage_idx], running[0])) from e
    raise
  finally:
    manager.wait()
    monitor.close()
  log.info("%s", summary(workdir, row, monitor.last_val, trained, manager.all_steps(), total_steps))
  return row


def _iterator_for_step(config, stages, step, manifest_path=None):
  """The train data stream of the stage that `step` falls in; stage i shuffles with data.seed + i."""
  idx, _ = stage_at(stages, step)
  return iter(_batch_iterator(config, stages[idx], "train", config.data.seed + idx, manifest_path))
