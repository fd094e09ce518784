"""Training runs as a user starts them, `python -m moejax.train` in subprocesses, for the tests of the
loop across processes, kills and object storage; and a session-wide folder that xdist workers share.
"""

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time

# A two-layer hybrid that compiles and steps in seconds on a CPU.
SMALL_MODEL = {
    "data.vocab_size": 300, "data.max_bytes": 300_000, "data.shuffle_buffer": 64,
    "model.d_model": 32, "model.num_layers": 2, "model.layer_pattern": "KM", "model.num_dense_layers": 0,
    "model.kda.num_heads": 2, "model.kda.head_k_dim": 16, "model.kda.head_v_dim": 16,
    "model.kda.gate_rank": 8, "model.mla.num_heads": 2, "model.mla.q_lora_rank": 16,
    "model.mla.kv_lora_rank": 16, "model.mla.qk_nope_head_dim": 16, "model.mla.v_head_dim": 16,
    "model.attnres.block_size": 2, "model.moe.num_experts": 4, "model.moe.top_k": 2,
    "model.moe.shared_hidden_dim": 32, "model.moe.latent_dim": 16, "model.moe.expert_hidden_dim": 16,
    "optim.lr": 3e-3, "optim.warmup_steps": 5,
}


def write_config_file(path, overrides: dict) -> str:
  """An experiment file (as under experiments/) applying `overrides` to the base config."""
  with open(path, "w") as f:
    f.write("from moejax.config import base_config\n\n\n"
            f"OVERRIDES = {overrides!r}\n\n\n"
            "def get_config():\n"
            "  c = base_config()\n"
            "  for dotted, value in OVERRIDES.items():\n"
            "    *parents, leaf = dotted.split('.')\n"
            "    node = c\n"
            "    for p in parents:\n"
            "      node = node[p]\n"
            "    node[leaf] = value\n"
            "  return c\n")
  return str(path)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def train_env(devices: int, **extra) -> dict:
  """The environment of a training subprocess with `devices` CPU devices; the parent's compilation
  cache settings (tests/conftest.py) carry over, so each program compiles once per session."""
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), **extra)


def start_training(config_file, workdir, log_path, *, processes: int = 1, devices: int = 1,
                   args=(), per_process_args=None, env=None) -> list[subprocess.Popen]:
  """`processes` processes of one run (connected through a coordinator on 127.0.0.1), each with
  `devices` CPU devices; stderr of process i goes to `log_path`.i."""
  port = free_port()
  procs = []
  for i in range(processes):
    cmd = [sys.executable, "-m", "moejax.train", f"--config={config_file}", f"--workdir={workdir}", *args]
    if processes > 1:
      cmd += [f"--coordinator=127.0.0.1:{port}", f"--num_processes={processes}", f"--process_id={i}"]
    cmd += list(per_process_args[i]) if per_process_args else []
    with open(f"{log_path}.{i}", "w") as err:
      procs.append(subprocess.Popen(cmd, env=env or train_env(devices), stdout=subprocess.DEVNULL,
                                    stderr=err))
  return procs


def wait_all(procs, log_path, timeout: float = 600) -> None:
  """Waits for every process; fails with the logs where one did not exit 0."""
  try:
    for p in procs:
      p.wait(timeout=timeout)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  bad = [i for i, p in enumerate(procs) if p.returncode != 0]
  if bad:
    logs = "\n".join(f"--- process {i} (exit {procs[i].returncode}):\n"
                     + open(f"{log_path}.{i}").read()[-3000:] for i in bad)
    raise AssertionError(f"training processes {bad} failed:\n{logs}")


def read_rows(metrics_path) -> list[dict]:
  with open(metrics_path) as f:
    return [json.loads(line) for line in f]


def losses(rows) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in rows}


@contextlib.contextmanager
def locked(path):
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def session_folder(tmp_path_factory, name: str):
  """A folder that all xdist workers of this session see, for what is built once under `locked`."""
  base = tmp_path_factory.getbasetemp()
  root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
  root.mkdir(exist_ok=True)
  return root


# The runs that the multi-process and object-storage tests compare: STEPS steps, a checkpoint and an
# evaluation every EVERY, on two devices of an expert axis: the rows split over both, the experts too, and
# tokens sent to their experts' devices by all-to-all (between processes where each has one device).
STEPS, EVERY = 12, 6


def run_overrides(shared, **more):
  return {**SMALL_MODEL, "data.cache_dir": str(shared / "data"), "data.source": str(shared / "corpus"),
          "data.valid_fraction": 0.2,
          "train.stages": ((64, STEPS, 512),), "train.checkpoint_every": EVERY, "train.keep_checkpoints": 5,
          "train.eval_every": EVERY, "train.eval_batches": 1, "train.log_every": 1,
          "train.progress_bar": False, "train.mesh.expert": 2, **more}


def write_corpus(folder) -> list[str]:
  """The first standard-library modules under 16 KB, about 300 KB: a local folder (and, for the
  object-store tests, the same files in a bucket) that prepares to the same data wherever it is read
  from. Returns the file names."""
  folder.mkdir(exist_ok=True)
  root = sysconfig.get_paths()["stdlib"]
  total, names = 0, []
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name)
    if name.endswith(".py") and os.path.getsize(path) < 16_000 and total < 300_000:
      shutil.copyfile(path, folder / name)
      total += os.path.getsize(path)
      names.append(name)
  return names


def shared_runs_folder(tmp_path_factory):
  root = session_folder(tmp_path_factory, "moejax_runs")
  with locked(root / "corpus.lock"):
    if not (root / "corpus.done").exists():
      write_corpus(root / "corpus")
      (root / "corpus.done").write_text("")
  return root


def train(shared, name, *, processes, devices, overrides=None, resume_from=None):
  """Runs to the end in shared/name (a copy of `resume_from`'s workdir without its last checkpoint,
  if given); returns the metrics rows."""
  workdir = shared / name
  shutil.rmtree(workdir, ignore_errors=True)
  if resume_from is not None:
    shutil.copytree(resume_from, workdir)
    shutil.rmtree(workdir / "checkpoints" / str(STEPS))
  config = write_config_file(shared / f"{name}.py", run_overrides(shared, **(overrides or {})))
  log = shared / f"{name}.log"
  procs = start_training(config, workdir, log, processes=processes, devices=devices,
                         args=["--distributed_timeout=60"])
  wait_all(procs, log)
  return read_rows(workdir / "metrics.jsonl")


def two_and_one(shared):
  """The uninterrupted runs, built once a session: two processes of one device, and one process of
  two devices reading the same two data streams. Returns their metrics rows."""
  with locked(shared / "runs.lock"):
    if not (shared / "runs.done").exists():
      two = start_training(write_config_file(shared / "two.py", run_overrides(shared)), shared / "two",
                           shared / "two.log", processes=2, devices=1, args=["--distributed_timeout=60"])
      one = start_training(write_config_file(shared / "one.py", run_overrides(shared, **{"data.streams": 2})),
                           shared / "one", shared / "one.log", processes=1, devices=2)
      wait_all(two, shared / "two.log")
      wait_all(one, shared / "one.log")
      (shared / "runs.done").write_text("")
  return read_rows(shared / "two" / "metrics.jsonl"), read_rows(shared / "one" / "metrics.jsonl")


def kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> bool:
  """SIGKILLs `proc` as soon as `ready()` holds; returns whether it was still running then (False: it
  ended, or the timeout passed, before)."""
  try:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not ready():
      time.sleep(0.02)
    alive = proc.poll() is None and time.monotonic() < deadline
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return alive
