"""The training loop that `python -m moejax.train` runs.

Runs the progressive-context stages of `config.train.stages` in order inside one process, checkpoints
the whole train state and the data iterator, and resumes from the newest readable checkpoint in
`--workdir` when restarted.
"""

import logging
import time

import jax
import numpy as np

from moejax import storage
from moejax.config import passes_per_step
from moejax.data import load_manifest, make_dataset, mqar
from moejax.data.config import is_synthetic
from moejax.data.prepare import prepare
from moejax.data.streams import rows_per_stream, stream_iterator
from moejax.device_memory import DeviceOutOfMemoryError, is_out_of_memory, out_of_memory_message
from moejax.errors import ConfigError
from moejax.flops import flop_counter, spec_bf16_peak
from moejax.model import build_model
from moejax.parallel import distributed
from moejax.parallel.mesh import MESH_AXES, batch_sharding, make_mesh
from moejax.training import checkpoint as ckpt_lib
from moejax.training import run_files
from moejax.training.monitor import Monitor, summary, to_row
from moejax.training.run_files import stage_at
from moejax.training.state import sharded_state_plan
from moejax.training.step import jit_eval_step, jit_train_step
from moejax.vision.pipeline import make_vision_dataset

log = logging.getLogger("moejax.train")


def _batch_iterator(config, stage, split, seed, manifest_path, streams: int):
  """This process's batches of `stage` (seq_len, steps, tokens): the rows of its data streams
  (moejax.data.streams), each stream a disjoint shard of the data."""
  seq_len, _, tokens = stage
  rows = rows_per_stream(tokens // seq_len, streams, f"a batch of stage (seq_len {seq_len}, {tokens} tokens)")
  if is_synthetic(config.data):  # rows drawn by moejax.data.mqar
    make = lambda k: mqar.MQARIterator(config.data.mqar, seq_len=seq_len, batch_size=rows, seed=seed,
                                       split=split, stream=k)
  elif config.model.vision.enabled:  # rows of images and text (moejax.vision.pipeline)
    make = lambda k: make_vision_dataset(config, manifest_path, split, seq_len=seq_len, batch_size=rows,
                                         seed=seed, shard_index=k, shard_count=streams)
  else:
    d = config.data
    make = lambda k: make_dataset(manifest_path, split, seq_len=seq_len, batch_size=rows, seed=seed,
                                  shard_index=k, shard_count=streams, shuffle=split == "train",
                                  shuffle_buffer=d.shuffle_buffer, read_threads=d.read_threads,
                                  num_workers=d.num_workers)
  return stream_iterator(make, streams, jax.process_index(), jax.process_count())


def _prepare_once(data_cfg) -> str:
  """The prepared corpus's manifest path. Process 0 prepares it while the others wait; they then
  find it in a shared cache (or, on local disks, build the same bytes) and check that its content
  is process 0's."""
  if distributed.is_primary():
    manifest_path = prepare(data_cfg)
    content = load_manifest(manifest_path)["content_sha256"]
    distributed.share("corpus", content)
    return manifest_path
  content = distributed.share("corpus", None)  # waits until process 0 has prepared
  manifest_path = prepare(data_cfg)
  if load_manifest(manifest_path)["content_sha256"] != content:
    raise ConfigError(f"process {jax.process_index()} prepared other data ({manifest_path}) than process 0: "
                      f"give every process the same data config and corpus")
  return manifest_path


def evaluate(eval_step, state, config, stage, manifest_path: str, streams: int,
             to_device=lambda batch: batch) -> dict:
  """Validation loss over config.train.eval_batches batches of the stage's size, each taken in the
  train step's passes (train.microbatch_tokens): the forward never holds more than a pass."""
  seq_len, steps, tokens = stage
  passes = passes_per_step(seq_len, tokens, config.train.microbatch_tokens)
  it = _batch_iterator(config, (seq_len, steps, tokens // passes), "validation", config.data.seed,
                       manifest_path, streams)
  total, count = 0.0, 0.0
  for _ in range(config.train.eval_batches * passes):
    m = eval_step(state, to_device(next(it)))
    total += float(m["nll"]) * float(m["tokens"])
    count += float(m["tokens"])
  return {"val_loss": total / max(count, 1.0)}


def run(config, workdir: str) -> dict:
  """Trains to the end of the last stage, or until train.time_limit_s; returns the last metrics row.

  `workdir` may be relative (to the current directory) or a URL (s3://, gs://), which is kept as given.
  In a multi-process run (moejax.parallel.distributed) every process calls this: each reads its own
  data streams and writes its shards of the checkpoints, and process 0 alone writes the run's other
  files (run.json, data.json, config.json, tokenizer.json, the metrics log and TensorBoard)."""
  began = time.perf_counter()
  workdir = storage.resolve_workdir(workdir)
  model = build_model(config)  # validates the config first
  primary = distributed.is_primary()
  if primary:
    storage.makedirs(workdir)
  if is_synthetic(config.data):  # nothing to prepare: the rows are drawn as the run reads them
    manifest_path = manifest = None
  else:
    # Prepared once: every stream of the run reads these shards, even if the corpus changes meanwhile.
    manifest_path = _prepare_once(config.data)
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
  # A restore comes back in the template's placement; the fresh state is drawn only if none is restored.
  template, draw_state, optimizer, shardings = sharded_state_plan(model, config, total_steps, mesh)
  rows = batch_sharding(mesh)
  to_device = lambda batch: jax.tree.map(lambda x: jax.make_array_from_process_local_data(rows, x), batch)
  before = run_files.read_run_pin(workdir)
  streams = run_files.data_streams(config, before)
  iterator_for_step = lambda s: _iterator_for_step(config, stages, s, manifest_path, streams)
  manager = ckpt_lib.Manager(storage.join(workdir, "checkpoints"), config.train.keep_checkpoints)
  # A changed data order is refused before anything is restored (and then again at the step restored).
  run_files.check_run(workdir, config, stages, manager.latest_step(), before, streams, warn=False)
  restored = manager.restore_latest(template, iterator_for_step)
  data_pin = run_files.data_pin(manifest_path, manifest, config.data)
  run_files.check_data(workdir, data_pin, manifest_path, resuming=restored is not None)
  fresh_stream, run_pin = run_files.check_run(workdir, config, stages,
                                              None if restored is None else int(restored[0].step), before,
                                              streams)
  distributed.barrier("moejax/run-checked")  # every process has read run.json before it is rewritten
  if primary:
    run_files.write_json(storage.join(workdir, "data.json"), data_pin)
    run_files.save_for_inference(workdir, config, manifest_path, manifest)
    run_files.write_json(storage.join(workdir, "run.json"), run_pin)
  if restored is None:
    state = draw_state(jax.random.key(config.train.seed))
    data_it = iterator_for_step(0)
    log.info("initialised the state (%.1f s since the start)", time.perf_counter() - began)
  else:
    state, data_it = restored
    log.info("resumed from step %d (%.1f s since the start)", int(state.step), time.perf_counter() - began)
    if fresh_stream:
      data_it = iterator_for_step(int(state.step))
      log.info("step %d is in stage %d, where the saved run was not at this step: its stream starts afresh",
               int(state.step), stage_at(stages, int(state.step))[0])

  train_step = jit_train_step(model, optimizer, config, total_steps, shardings)
  eval_step = jit_eval_step(model, config)
  monitor = Monitor(workdir, config, total_steps, start_step=int(state.step), writes=primary,
                    process_index=jax.process_index())
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
  window = {"start": None, "tokens": 0.0, "flops": 0.0}
  # MFU: the model FLOPs of the window's steps (moejax.flops: attention within documents only, counted
  # on this process's rows) over the data-sheet peak of the mesh's cards; none where the card is unknown.
  peak = spec_bf16_peak(mesh.devices.flat[0].device_kind)
  count_flops = flop_counter(config, template.params)
  flops_per_token = lambda segment_ids: count_flops(segment_ids)["total"]
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
    # The tokens the model read: every real (not padding) one, where row["tokens"] counts those with a
    # loss (fewer where the loss mask leaves some out: MQAR's questions, vision's image placeholders).
    # Counted on this process's rows, which every process has alike.
    tokens = extra.pop("tokens_fed") * jax.process_count()
    flops = tokens * extra.pop("flops_per_token")
    row.update(step=step_done, **extra)
    trained["steps"] += 1
    if compiled_since is not None:
      log.info("step %d: %.1f s with the compile", step_done, now - compiled_since)
      window.update(start=now, tokens=0.0, flops=0.0)
    else:
      window["tokens"] += tokens
      window["flops"] += flops
      if measure and window["start"] is not None and now > window["start"]:
        seconds = now - window["start"]
        row["tokens_per_s"] = window["tokens"] / seconds
        if peak is not None:
          row["mfu"] = window["flops"] / (seconds * peak * mesh.size)
        trained["tokens"] += window["tokens"]
        trained["seconds"] += seconds
        window.update(start=now, tokens=0.0, flops=0.0)
    if eval_state is not None:
      running[0] = f"evaluation at step {step_done}"
      row.update(evaluate(eval_step, eval_state, config, stages[row["stage"]], manifest_path, streams,
                          to_device))
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

  def out_of_time(step_done: int) -> bool:
    """Whether the run stops after `step_done`: checked where the step logs, on process 0's clock."""
    limit = config.train.time_limit_s
    if not limit or step_done % config.train.log_every or step_done >= total_steps:
      return False
    late = str(time.perf_counter() - began > limit) if primary else None
    return distributed.share(f"time-up-at-{step_done}", late) == "True"

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
                 "flops_per_token": flops_per_token(batch["segment_ids"]),
                 "tokens_fed": float(np.count_nonzero(batch["segment_ids"]))}
        if pending is not None:
          row, pending = finish(pending), None
        evaluate_now = bool(config.train.eval_every) and step % config.train.eval_every == 0
        new_stage, _ = stage_at(stages, step)
        switched = new_stage != stage_idx
        # Every stage boundary is saved too: the next stage's first step compiles anew and may not fit,
        # and a restart there should not repeat the end of the stage before.
        save_due = (save_due or switched or step % config.train.checkpoint_every == 0
                    or step == total_steps)
        time_up = out_of_time(step)
        save_due = save_due or time_up
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
          data_it = iterator_for_step(step)
          log.info("stage %d: seq_len=%d", stage_idx, stages[stage_idx][0])
        # A state that just skipped an update is not saved: the newest checkpoint stays a good one.
        if save_due and int(state.bad_steps) == 0:
          started = time.perf_counter()
          monitor.flush()  # the steps up to a checkpoint are never recorded again after a resume from it
          manager.save(step, state, data_it)
          monitor.checkpoint_saved(time.perf_counter() - started)
          log.info("step %d: checkpoint to %s (written in the background)", step,
                   storage.join(str(manager.directory), str(step)))
          if window["start"] is not None:
            window["start"] += time.perf_counter() - started  # nor is saving
          save_due = False
        if time_up:
          log.warning("step %d: train.time_limit_s=%s reached; stopping here, with %d of %d steps trained "
                      "(the same command resumes)", step, config.train.time_limit_s, step, total_steps)
          break
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
  if primary:
    log.info("%s", summary(workdir, row, monitor.last_val, trained, manager.all_steps(), total_steps))
  else:
    log.info("process %d: done at step %s", jax.process_index(), row.get("step", step))
  return row


def _iterator_for_step(config, stages, step, manifest_path, streams):
  """The train data of the stage that `step` falls in; stage i shuffles with data.seed + i."""
  idx, _ = stage_at(stages, step)
  return _batch_iterator(config, stages[idx], "train", config.data.seed + idx, manifest_path, streams)
