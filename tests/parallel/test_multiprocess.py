"""Training across processes, as `python -m moejax.train --coordinator ... --process_id I` runs it:
several local processes on 127.0.0.1, each with its own CPU devices, talking through JAX's
distributed runtime (gloo collectives).

- Two processes of one device make the same losses as one process of two devices on the same global
  batch, on a mesh of 2 experts: rows split over both devices, experts too, and tokens travel to
  their experts by all-to-all, between the processes in the first case.
- A checkpoint of two processes resumes in one, with the data position kept: the resumed steps equal
  the uninterrupted run's. (One process's checkpoint resumed by two: tests/storage, from a bucket.)
- The Prometheus endpoint of each process serves the per-expert gauges during a run; killing one
  process makes the other exit non-zero within the distributed timeout.
"""

import signal
import time
import urllib.request

import numpy as np
import pytest
import runs

pytestmark = pytest.mark.slow

STEPS, EVERY = runs.STEPS, runs.EVERY
train, run_overrides = runs.train, runs.run_overrides


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
  return runs.shared_runs_folder(tmp_path_factory)


@pytest.fixture(scope="session")
def two_and_one(shared):
  return runs.two_and_one(shared)


def assert_same_losses(got, want, steps):
  got, want = runs.losses(got), runs.losses(want)
  assert sorted(got) == list(steps) and set(steps) <= set(want)
  np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def test_two_processes_train_as_one_process_with_two_devices(shared, two_and_one):
  two, one = two_and_one
  assert_same_losses(two, one, range(1, STEPS + 1))
  val = lambda rows: [r["val_loss"] for r in rows if "val_loss" in r]
  np.testing.assert_allclose(val(two), val(one), rtol=1e-5)
  assert len(val(two)) == STEPS // EVERY
  # Process 0 alone wrote the run's files; every process wrote its stream's data position.
  data = shared / "two" / "checkpoints" / str(EVERY) / "data"
  assert sorted(p.name for p in data.iterdir() if p.suffix == ".json") == ["stream_0-of-2.json",
                                                                           "stream_1-of-2.json"]


def test_two_processes_checkpoint_resumes_in_one(shared, two_and_one):
  """Two processes' checkpoint at step 6, resumed by one process of two devices."""
  two, _ = two_and_one
  resumed_by_one = train(shared, "two_then_one", processes=1, devices=2, resume_from=shared / "two")
  assert_same_losses(resumed_by_one, two, range(1, STEPS + 1))


def scrape(port: int) -> str:
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
    return r.read().decode()


def test_metrics_endpoints_and_a_killed_process_stops_the_other(shared, tmp_path):
  """Each process serves its gauges (the load of every expert of every MoE layer included); after
  SIGKILL to process 1, process 0 exits non-zero well within the distributed timeout."""
  timeout = 30
  ports = [runs.free_port(), runs.free_port()]
  config = runs.write_config_file(tmp_path / "long.py",
                                  run_overrides(shared, **{"train.stages": ((64, 400, 512),),
                                                           "train.eval_every": 0}))
  log = tmp_path / "long.log"
  procs = runs.start_training(config, tmp_path / "run", log, processes=2, devices=1,
                              args=[f"--distributed_timeout={timeout}"],
                              per_process_args=[[f"--config.train.metrics_port={p}"] for p in ports])
  try:
    pages, deadline = {}, time.monotonic() + 300
    while len(pages) < 2 and time.monotonic() < deadline:
      assert all(p.poll() is None for p in procs), log.with_suffix(".log.0").read_text()[-3000:]
      for i, port in enumerate(ports):
        try:
          page = scrape(port)
        except OSError:
          continue
        if "moejax_expert_load{" in page and "moejax_step{" in page:
          pages[i] = page
      time.sleep(0.2)
    assert len(pages) == 2, "no process served its expert gauges in time"
    for i, page in pages.items():
      loads = [line for line in page.splitlines() if line.startswith("moejax_expert_load{")]
      # Both layers of the small model (KM, no dense layer) are MoE layers of 4 experts.
      layers = {line.split('layer="')[1].split('"')[0] for line in loads}
      assert len(layers) == 2 and len(loads) == 2 * 4
      assert all(f'process="{i}"' in line for line in loads)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    procs[0].wait(timeout=timeout + 60)
    waited = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert procs[0].returncode != 0 and waited < timeout + 15, (procs[0].returncode, waited)
