"""Renders deploy/k8s/jobset.yaml: the JobSet that trains on N hosts of G GPUs each.

python -m deploy.k8s.render --hosts 4 --image IMAGE --config experiments/h200.py --workdir s3://bucket/run \
    [--name moejax --gpus-per-host 8 --port 1234 --metrics-port 9090 --max-restarts 3] [-- MORE ARGS]

prints the JobSet (pipe it to `kubectl apply -f -`). Arguments after `--` go to moejax.train as they are
(e.g. `-- --config.train.steps=1000`). Each pod runs

  python -m moejax.train --config CONFIG --workdir WORKDIR --config.train.metrics_port=METRICS_PORT

with MOEJAX_COORDINATOR (process 0's pod and PORT), MOEJAX_NUM_PROCESSES and MOEJAX_PROCESS_ID (the pod's
index) in its environment, for moejax.parallel.distributed.initialize().
"""

import argparse
import json
import re
import string
import sys
from pathlib import Path

import yaml

TEMPLATE = Path(__file__).with_name("jobset.yaml")
# The replicated job's name: the pods are <name>-host-0-<process index>.
JOB = "host"
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://\S+$")


def coordinator_address(name: str, port: int) -> str:
  """host:port of process 0: its pod's hostname under the JobSet's headless service (named `name`)."""
  return f"{name}-{JOB}-0-0.{name}:{port}"


def _check_int(what: str, value, low: int, high: int | None = None) -> None:
  # bool is an int to Python, and True hosts is surely a mistake.
  if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
    bound = f"between {low} and {high}" if high else f">= {low}"
    raise ValueError(f"{what} must be an integer {bound}, not {value!r}")


def _check_word(what: str, value) -> None:
  if not isinstance(value, str) or not value or any(c.isspace() for c in value):
    raise ValueError(f"{what} must be a non-empty string without spaces, not {value!r}")


def validate(*, hosts, image, config, workdir, name, gpus_per_host, port, metrics_port, max_restarts):
  _check_int("hosts", hosts, 1)
  _check_int("gpus_per_host", gpus_per_host, 1)
  _check_int("port", port, 1, 65535)
  _check_int("metrics_port", metrics_port, 1, 65535)
  _check_int("max_restarts", max_restarts, 0)
  if port == metrics_port:
    raise ValueError(f"port and metrics_port must differ (both {port})")
  for what, value in (("image", image), ("config", config), ("workdir", workdir)):
    _check_word(what, value)
  # Every host writes and reads the same checkpoints: a relative path would land in each pod's own
  # ephemeral filesystem.
  if not (_URL.match(workdir) or workdir.startswith("/")):
    raise ValueError(f"workdir must be a URL (gs://, s3://, ...) or an absolute path on storage that every "
                     f"host mounts, not {workdir!r}")
  if not isinstance(name, str) or not _DNS_1035.match(name):
    raise ValueError(f"name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a "
                     f"letter and ending with a letter or digit), not {name!r}")
  # The pods' hostnames are DNS labels too, of at most 63 characters; the last pod's is the longest.
  longest = f"{name}-{JOB}-0-{hosts - 1}"
  if len(longest) > 63:
    raise ValueError(f"name {name!r} is too long: the pod hostname {longest!r} would be {len(longest)} "
                     f"characters, over the 63 of a DNS label")


def render(*, hosts: int, image: str, config: str, workdir: str, name: str = "moejax",
           gpus_per_host: int = 8, port: int = 1234, metrics_port: int = 9090, max_restarts: int = 3,
           extra_args=()) -> str:
  """The JobSet as YAML text. Raises ValueError, saying which, for a value Kubernetes or the run would
  refuse."""
  validate(hosts=hosts, image=image, config=config, workdir=workdir, name=name,
           gpus_per_host=gpus_per_host, port=port, metrics_port=metrics_port, max_restarts=max_restarts)
  args = ["--config", config, "--workdir", workdir, f"--config.train.metrics_port={metrics_port}",
          *map(str, extra_args)]
  # Strings go in as JSON, which YAML reads as quoted scalars: an image or path with ':' or '#' stays
  # one string. Integers go in bare.
  text = string.Template(TEMPLATE.read_text()).substitute(
      NAME=name, JOB=JOB, HOSTS=hosts, GPUS=gpus_per_host, PORT=port, METRICS_PORT=metrics_port,
      MAX_RESTARTS=max_restarts, IMAGE=json.dumps(image), ARGS=json.dumps(args),
      COORDINATOR=json.dumps(coordinator_address(name, port)))
  yaml.safe_load(text)  # a template edit that broke the YAML fails here, not in kubectl
  # The template's opening comment tells how to render it: the rendered file says what made it instead.
  body = text[text.index("apiVersion:"):]
  return f"# Rendered by python -m deploy.k8s.render from deploy/k8s/jobset.yaml.\n{body}"


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  extra = []
  if "--" in argv:
    at = argv.index("--")
    argv, extra = argv[:at], argv[at + 1:]
  parser = argparse.ArgumentParser(prog="python -m deploy.k8s.render",
                                   description="Prints the JobSet that runs moejax.train on several hosts.",
                                   epilog="Arguments after -- are passed to moejax.train.")
  parser.add_argument("--hosts", type=int, required=True, help="number of hosts (JAX processes)")
  parser.add_argument("--image", required=True, help="container image built from deploy/Dockerfile")
  parser.add_argument("--config", required=True, help="experiment config, a path inside the image")
  parser.add_argument("--workdir", required=True, help="run directory every host reaches (a URL or a "
                      "shared absolute path)")
  parser.add_argument("--name", default="moejax", help="JobSet name, a DNS-1035 label (default %(default)s)")
  parser.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per pod (default %(default)s)")
  parser.add_argument("--port", type=int, default=1234, help="coordinator port (default %(default)s)")
  parser.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (default %(default)s)")
  parser.add_argument("--max-restarts", type=int, default=3,
                      help="restarts of the whole JobSet after a failure (default %(default)s)")
  a = parser.parse_args(argv)
  try:
    text = render(hosts=a.hosts, image=a.image, config=a.config, workdir=a.workdir, name=a.name,
                  gpus_per_host=a.gpus_per_host, port=a.port, metrics_port=a.metrics_port,
                  max_restarts=a.max_restarts, extra_args=extra)
  except ValueError as e:
    parser.error(str(e))
  sys.stdout.write(text)


if __name__ == "__main__":
  main()
