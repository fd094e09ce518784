"""The files a training run keeps beside its checkpoints, and the checks a restart makes against them.

  run.json        the stages and the settings a resume must keep (`check_run`)
  data.json       the content hash of the corpus and tokenizer trained on (`check_data`)
  config.json,    what `moejax.inference.load_model` needs besides the checkpoints
  tokenizer.json

Process 0 writes them; every process reads them (moejax.training.loop).
"""

import hashlib
import json
import logging
import os

import jax

from moejax import storage
from moejax.errors import ConfigError

log = logging.getLogger("moejax.train")


def stage_at(stages, step: int):
  """(stage index, first step of that stage) for a global step; past the end -> the last stage."""
  start = 0
  for i, (_, steps, _) in enumerate(stages):
    if step < start + steps:
      return i, start
    start += steps
  return len(stages) - 1, start - stages[-1][1]


def data_pin(manifest_path: str | None, manifest: dict | None, data_cfg) -> dict:
  """What the run's data is: the prepared corpus's content and tokenizer hashes, or a synthetic source's
  settings (manifest None)."""
  if manifest is None:
    return {"synthetic": data_cfg.source, "settings": data_cfg[data_cfg.source].to_dict()}
  tokenizer_file = os.path.join(os.path.dirname(manifest_path), manifest["tokenizer"]["file"])
  with open(tokenizer_file, "rb") as f:
    tokenizer_sha256 = hashlib.sha256(f.read()).hexdigest()
  return {"content_sha256": manifest["content_sha256"], "tokenizer_sha256": tokenizer_sha256}


def check_data(workdir: str, pin: dict, manifest_path: str, resuming: bool) -> None:
  """A resume on other data (a corpus edited since, another tokenizer) than workdir/data.json records
  is refused: the weights would read token ids with other meanings, and the saved data position
  would index another dataset."""
  path = storage.join(workdir, "data.json")
  if resuming and storage.exists(path):
    trained_on = json.loads(storage.read_text(path))
    if trained_on != pin:
      raise ConfigError(f"the checkpoints in {workdir} were trained on other data ({path}: {trained_on}) "
                        f"than {manifest_path} holds now ({pin}): restore the corpus and data config, or "
                        f"start in a new workdir")


# What moejax.inference.load_model reads from a workdir besides the checkpoints.
CONFIG_FILE, TOKENIZER_FILE = "config.json", "tokenizer.json"


def save_for_inference(workdir: str, config, manifest_path: str | None, manifest: dict | None) -> None:
  """The run's validated config and its tokenizer, next to the checkpoints: a workdir alone is enough to
  load the model and generate (moejax.inference.load_model), wherever the prepared corpus lives. A
  synthetic source (manifest None) has no tokenizer."""
  write_json(storage.join(workdir, CONFIG_FILE), config.to_dict())
  if manifest is None:
    return
  storage.upload(os.path.join(os.path.dirname(manifest_path), manifest["tokenizer"]["file"]),
                 storage.join(workdir, TOKENIZER_FILE))


def write_json(path: str, value) -> None:
  storage.write_text(path, json.dumps(value))


# Settings that order the data stream: a checkpoint's saved data position indexes the stream they made.
_STREAM_FIELDS = ("data.seed", "data.shuffle_buffer", "data.valid_fraction")
# Settings of the learning-rate schedule, which is rebuilt from the config on every start.
_SCHEDULE_FIELDS = ("optim.lr", "optim.adam_lr", "optim.warmup_steps", "optim.final_lr_fraction")


def read_run_pin(workdir: str) -> dict | None:
  """workdir/run.json of an earlier start of the run, or None. A run.json from before data streams
  existed was written by one process reading one stream."""
  path = storage.join(workdir, "run.json")
  if not storage.exists(path):
    return None
  before = json.loads(storage.read_text(path))
  before.setdefault("data.streams", 1)
  return before


def data_streams(config, before: dict | None) -> int:
  """The run's number of data streams (moejax.data.streams): data.streams, else the number the run
  started with (run.json), else one per process."""
  return config.data.streams or (before or {}).get("data.streams") or jax.process_count()


def check_run(workdir: str, config, stages, step: int | None, before: dict | None,
              streams: int, warn: bool = True) -> tuple[bool, dict]:
  """(fresh, pin): `pin` is what workdir/run.json records, the stages and the settings a resume must
  keep; a resume from `step` (None: a fresh start) is checked against `before` (the saved run.json),
  and `fresh` says whether the resumed step's data stream must start afresh rather than from the
  checkpoint's saved position.

  Refused, with ConfigError: other stages before the one the saved run was in at `step`, another
  sequence length or batch for that one (its saved data position indexes that stream), or another
  data order (`_STREAM_FIELDS`, the number of data streams). Allowed: stages appended, the current
  one lengthened or shortened, other schedule settings, with a warning where the learning-rate
  schedule changes (it is rebuilt for the new total, so the rate from this step on is not the one the
  earlier run planned), and another process count that divides the streams. Where the step now falls
  in another stage than the saved run's (a stage appended after the run ended, or the current one
  cut short), that stage's stream starts from its beginning (fresh)."""
  path = storage.join(workdir, "run.json")
  get = lambda name: config[name.split(".")[0]][name.split(".")[1]]
  pin = {"stages": [list(s) for s in stages], "total_steps": sum(s[1] for s in stages),
         **{name: get(name) for name in _STREAM_FIELDS + _SCHEDULE_FIELDS}, "data.streams": streams}
  fresh = False
  if step is not None and before is not None:
    old_stages = [tuple(s) for s in before["stages"]]
    i, _ = stage_at(old_stages, step)
    kept = (len(stages) > i and old_stages[:i] == list(stages[:i])
            and (stages[i][0], stages[i][2]) == (old_stages[i][0], old_stages[i][2]))
    differences = lambda names: [f"{name}: {before.get(name)!r} -> {pin[name]!r}" for name in names
                                 if before.get(name) != pin[name]]
    changed = differences(_STREAM_FIELDS + ("data.streams",))
    if not kept:
      changed.insert(0, f"train.stages: {before['stages']} -> {pin['stages']} (step {step} is in stage "
                        f"{i} of the saved run: the stages before it, its sequence length and its batch "
                        f"must stay)")
    if changed:
      raise ConfigError(f"the checkpoints in {workdir} (step {step}) were made by a run whose data stream "
                        f"this config changes: {'; '.join(changed)}. Restore those settings, start in a new "
                        f"workdir, or delete {path} to resume on the new stream all the same")
    if (moved := differences(("total_steps",) + _SCHEDULE_FIELDS)) and warn:
      log.warning("resuming at step %d with another learning-rate schedule (%s): it is rebuilt for the new "
                  "settings, so the rate from here on is not the one the earlier run planned", step,
                  "; ".join(moved))
    fresh = stage_at(stages, step)[0] != i
  return fresh, pin


