"""Training into s3:// against a real S3 server on 127.0.0.1 (moto's server mode), data read from a
bucket too: a one-process run killed after a checkpoint and resumed from the bucket by two processes
logs the same losses as an uninterrupted one-process run on local disk; and the storage module's file
operations on the bucket."""

import json
import os

import numpy as np
import pytest
import runs
import s3fs

from moejax import storage
from moejax.storage.orbax_s3 import s3_kvstore_spec

pytestmark = pytest.mark.slow

BUCKET = "moejax-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
  """A local S3 server and the environment that points s3fs, TensorStore and subprocesses at it."""
  moto_server = pytest.importorskip("moto.server")
  import boto3

  server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=runs.free_port())
  server.start()
  host, port = server.get_host_and_port()
  env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
         "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
         "MOEJAX_CACHE_DIR": str(tmp_path_factory.mktemp("moejax_cache"))}
  before = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  # fsspec keeps one S3FileSystem per set of arguments, and the endpoint comes from the environment: a
  # filesystem made for an earlier server of this process (another test module's, now stopped) would
  # still be handed out.
  s3fs.S3FileSystem.clear_instance_cache()
  try:
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield env
  finally:
    for k, v in before.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_file_operations_on_a_bucket(s3, tmp_path):
  base = f"s3://{BUCKET}/files"
  storage.write_text(storage.join(base, "a.json"), '{"x": 1}')
  assert storage.exists(storage.join(base, "a.json")) and not storage.exists(storage.join(base, "b.json"))
  assert storage.read_text(storage.join(base, "a.json")) == '{"x": 1}'
  assert storage.download(storage.join(base, "a.json"), str(tmp_path / "a.json"))
  assert not storage.download(storage.join(base, "missing"), str(tmp_path / "missing"))
  mirror = storage.Mirror(storage.join(base, "run"))
  os.makedirs(os.path.join(mirror.local, "tb"), exist_ok=True)
  with open(os.path.join(mirror.local, "tb", "events"), "w") as f:
    f.write("1")
  mirror.push()
  again = storage.Mirror(storage.join(base, "run"))
  os.remove(os.path.join(again.local, "tb", "events"))
  again.pull(["tb/", "metrics.jsonl"])
  with open(os.path.join(again.local, "tb", "events")) as f:
    assert f.read() == "1"
  assert s3_kvstore_spec(f"s3://{BUCKET}/a/b") == {
      "driver": "s3", "bucket": BUCKET, "path": "a/b", "endpoint": s3["AWS_ENDPOINT_URL"],
      "aws_region": "us-east-1", "aws_credentials": {"type": "environment"}}


def test_train_into_s3_kill_and_resume(s3, tmp_path_factory, tmp_path):
  import s3fs

  shared = runs.shared_runs_folder(tmp_path_factory)
  _, uninterrupted = runs.two_and_one(shared)
  fs = s3fs.S3FileSystem()
  for name in sorted(os.listdir(shared / "corpus")):
    fs.put_file(str(shared / "corpus" / name), f"{BUCKET}/corpus/{name}")
  workdir = f"s3://{BUCKET}/run"
  config = runs.write_config_file(tmp_path / "s3.py", runs.run_overrides(
      shared, **{"data.source": f"s3://{BUCKET}/corpus", "data.cache_dir": str(tmp_path / "data"),
                 "data.streams": 2}))
  env = runs.train_env(2, **s3)
  log = tmp_path / "s3.log"
  (proc,) = runs.start_training(config, workdir, log, env=env)
  committed = f"{BUCKET}/run/checkpoints/{runs.EVERY}/commit_success.txt"

  def checkpoint_committed():
    fs.invalidate_cache()
    return fs.exists(committed)

  alive = runs.kill_when(proc, checkpoint_committed)
  assert alive, f"the run ended before it was killed:\n{(tmp_path / 's3.log.0').read_text()[-3000:]}"
  fs.invalidate_cache()
  assert fs.exists(committed) and not fs.exists(f"{BUCKET}/run/checkpoints/{runs.STEPS}/commit_success.txt")

  # Resumed by two processes of one device each, which split the run's two data streams.
  runs.wait_all(runs.start_training(config, workdir, log, processes=2, env=runs.train_env(1, **s3),
                                    args=["--distributed_timeout=60"]), log)
  assert "resumed from step 6" in (tmp_path / "s3.log.0").read_text()
  fs.invalidate_cache()
  rows = [json.loads(line) for line in fs.cat_file(f"{BUCKET}/run/metrics.jsonl").splitlines()]
  got, want = runs.losses(rows), runs.losses(uninterrupted)
  assert sorted(got) == list(range(1, runs.STEPS + 1))
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)], rtol=1e-5)
  names = {p.split("/run/", 1)[1] for p in fs.find(f"{BUCKET}/run")}
  assert {"run.json", "data.json", "config.json", "tokenizer.json"} <= names
  assert any(n.startswith("tb/") for n in names)
  assert f"checkpoints/{runs.STEPS}/commit_success.txt" in names
  # The model loads from the bucket as from a local workdir.
  from moejax.inference import load_model

  lm = load_model(workdir)
  assert lm.step == runs.STEPS and lm.tokenizer.decode(lm.tokenizer.encode("def f(x):")) == "def f(x):"
