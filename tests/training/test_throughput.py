"""What `run` logs about time and memory: tokens_per_s against the wall clock, whether dispatch returns
at once or only when the step is nearly done, and an out-of-memory step's message.

The train step is wrapped in a stand-in device that adds a known time to every step: either inside the
call before it returns (dispatch that blocks, as a big GPU step does once it fills the launch queue) or
in a queue behind the call, its metrics ready only when their step is done (asynchronous dispatch).
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
import test_train
from test_train import make_config

from moejax.device_memory import DeviceOutOfMemoryError, is_out_of_memory, use_default_memory_fraction
from moejax.training import loop

# test_train's fixtures: its data cache and (autouse) its persistent compilation cache, so that these
# runs compile only what the reference run has not.
shared, compilation_cache_dir = test_train.shared, test_train.compilation_cache_dir

DELAY = 0.4  # device seconds added to each step: several times the CPU step of the tiny model
STEPS = 8
# Compiles at 1; checkpoints at 3, 6 and 8; logs at 4 and 8; evaluates at 6 (excluded from the timing).
OVERRIDES = {"train.stages": ((64, STEPS, 512),), "train.log_every": 4, "train.checkpoint_every": 3,
             "train.eval_every": 6, "train.eval_batches": 1}
MEASURED = [3, 4, 6, 8]


class _Later:
  """A metric that can be read only once its step is done on the stand-in device."""

  def __init__(self, value, done):
    self.value, self.done = value, done

  def __array__(self, dtype=None, copy=None):
    self.done.result()
    return np.asarray(self.value, dtype=dtype)


class StandInDevice:
  """Runs each step for DELAY seconds more than the real step, one step at a time, and records when
  each step ran on it. Asynchronous: a single worker thread is the device's queue."""

  def __init__(self, blocking: bool):
    self.blocking = blocking
    self.queue = None if blocking else ThreadPoolExecutor(max_workers=1)
    self.spans = []  # (start, end) on the device, per step
    self.dispatch_s = []  # how long each call took to return

  def _execute(self, metrics, start=None):
    start = time.perf_counter() if start is None else start
    jax.block_until_ready(metrics)  # the real step (not its state, which the next step donates)
    time.sleep(DELAY)
    self.spans.append((start, time.perf_counter()))

  def wrap(self, step):
    def slow_step(state, batch):
      called = time.perf_counter()
      state, metrics = step(state, batch)
      if self.blocking:
        self._execute(metrics, start=called)
      else:
        done = self.queue.submit(self._execute, metrics)
        metrics = {k: _Later(v, done) for k, v in metrics.items()}
      self.dispatch_s.append(time.perf_counter() - called)
      return state, metrics

    return slow_step


def _timed(intervals, fn):
  """`fn`, recording the host interval of each call in `intervals`."""
  def call(*args, **kwargs):
    started = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      intervals.append((started, time.perf_counter()))

  return call


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking-dispatch", "async-dispatch"])
def test_logged_throughput_is_wall_clock_throughput(shared, tmp_path, monkeypatch, blocking):
  """Each logged tokens_per_s is the tokens since the previous measured step over the wall time from
  the end of that step on the device to the end of this one, less the evaluations and checkpoint saves
  in between (within 20%); only the measured steps carry one.

  Measured at dispatch instead, an asynchronous run would log far more than this; with evaluation or
  saving counted, far less. Host time between the steps (data, a busy CPU) is the run's own and counts."""
  device = StandInDevice(blocking)
  jit_train_step = loop.jit_train_step
  monkeypatch.setattr(loop, "jit_train_step", lambda *a, **k: device.wrap(jit_train_step(*a, **k)))
  excluded = []  # host intervals of evaluation and saving
  monkeypatch.setattr(loop, "evaluate", _timed(excluded, loop.evaluate))
  monkeypatch.setattr(loop.ckpt_lib.Manager, "save", _timed(excluded, loop.ckpt_lib.Manager.save))
  try:
    loop.run(make_config(shared / "data", **OVERRIDES), str(tmp_path))
  finally:
    if device.queue is not None:
      device.queue.shutdown()
  with open(tmp_path / "metrics.jsonl") as f:
    rows = {r["step"]: r for r in map(json.loads, f)}
  assert sorted(rows) == list(range(1, STEPS + 1))
  assert [s for s, r in rows.items() if "tokens_per_s" in r] == MEASURED
  assert len(excluded) == 4, excluded  # saves at 3, 6 and 8; evaluation at 6
  if not blocking:  # the stand-in is asynchronous indeed: its calls return long before their steps end
    assert np.median(device.dispatch_s[1:]) < DELAY / 4, device.dispatch_s
  ended = {s: end for s, (_, end) in enumerate(device.spans, start=1)}
  previous = 1
  for s in MEASURED:
    begin, end = ended[previous], ended[s]
    wall = end - begin - sum(max(0.0, min(b, end) - max(a, begin)) for a, b in excluded)
    # Every step's DELAY is in the window: the window is at least the device's busy time.
    assert wall >= DELAY * (s - previous)
    expected = sum(rows[t]["tokens"] for t in range(previous + 1, s + 1)) / wall
    assert rows[s]["tokens_per_s"] == pytest.approx(expected, rel=0.2), (s, rows[s]["tokens_per_s"], expected)
    previous = s


def _fail_with(message):
  def step(state, batch):
    raise jax.errors.JaxRuntimeError(message)

  return lambda *a, **k: step


def test_out_of_memory_names_the_settings_to_change(shared, tmp_path, monkeypatch):
  oom = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 53921349632 bytes. "
         "BufferAssignment OOM Debugging.")
  monkeypatch.setattr(loop, "jit_train_step", _fail_with(oom))
  config = make_config(shared / "data", **{"train.stages": ((64, 2, 512),), "train.eval_every": 0})
  with pytest.raises(DeviceOutOfMemoryError) as err:
    loop.run(config, str(tmp_path))
  message = str(err.value)
  for knob in ("train.microbatch_tokens=256", "model.remat", "model.moe.token_chunk", "model.ffn.token_chunk",
               "model.kda.seq_chunk", "train.stages", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
    assert knob in message, knob
  assert "(64, 2, 512)" in message and "the train step" in message
  assert isinstance(err.value.__cause__, jax.errors.JaxRuntimeError) and oom in str(err.value.__cause__)
  # Any other device error passes through as it was.
  other = jax.errors.JaxRuntimeError("INTERNAL: something else")
  assert not is_out_of_memory(other) and is_out_of_memory(jax.errors.JaxRuntimeError("Out of memory"))
  assert not is_out_of_memory(MemoryError("RESOURCE_EXHAUSTED"))  # the host's, not XLA's


def test_default_memory_fraction_leaves_the_users_setting():
  environ = {}
  assert use_default_memory_fraction(environ) and environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
  for name, value in (("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
                      ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")):
    environ = {name: value}
    assert not use_default_memory_fraction(environ) and environ == {name: value}
