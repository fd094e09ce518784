"""Where a multi-process run's settings come from (moejax.parallel.distributed.find_cluster): flags, the
environment the JobSet of deploy/k8s sets, SLURM, or nothing (one process)."""

import pytest
import yaml

from deploy.k8s import render
from moejax.errors import ConfigError
from moejax.parallel.distributed import Cluster, find_cluster


def test_flags_win_over_the_environment():
  env = {"MOEJAX_COORDINATOR": "other:1", "MOEJAX_NUM_PROCESSES": "8", "MOEJAX_PROCESS_ID": "3"}
  assert find_cluster("h0:1234", 2, 1, environ=env) == Cluster("h0:1234", 2, 1, "flags")


def test_the_jobsets_environment_is_what_initialize_reads():
  """Pod 2 of the rendered JobSet: its env (the completion index filled in as Kubernetes does)."""
  jobset = yaml.safe_load(render.render(hosts=4, image="img", config="experiments/h200.py",
                                        workdir="s3://bucket/run"))
  [container] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
  env = {e["name"]: e.get("value", "2") for e in container["env"] if e["name"].startswith("MOEJAX_")}
  cluster = find_cluster(environ=env)
  assert cluster.source == "environment" and cluster.num_processes == 4 and cluster.process_id == 2
  assert cluster.coordinator.endswith(":1234") and cluster.coordinator.startswith("moejax-")


def test_slurm_and_one_process():
  assert find_cluster(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}).source == "slurm"
  assert find_cluster(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
  assert find_cluster(environ={}) is None


@pytest.mark.parametrize("args,match", [
    (("h0:1234", 2, None), "missing --process_id"),
    (("h0", 2, 0), "must be HOST:PORT"),
    (("h0:1234", 2, 2), r"process id 2 must be in \[0, 2\)"),
    (("h0:1234", "two", 0), "must be an integer"),
])
def test_bad_settings_are_refused(args, match):
  with pytest.raises(ConfigError, match=match):
    find_cluster(*args, environ={})
