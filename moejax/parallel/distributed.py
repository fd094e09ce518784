"""Several processes, one run: JAX's own multi-process runtime (jax.distributed), set up from flags,
from the environment of a Kubernetes JobSet (deploy/k8s), or from SLURM.

Where the settings come from, first match wins:
  1. flags: `python -m moejax.train ... --coordinator HOST:PORT --num_processes N --process_id I`;
  2. the environment MOEJAX_COORDINATOR, MOEJAX_NUM_PROCESSES, MOEJAX_PROCESS_ID (what
     deploy/k8s/jobset.yaml sets on every pod);
  3. a SLURM job step of several tasks (SLURM_JOB_ID and SLURM_NTASKS > 1): JAX reads SLURM's own
     variables;
  4. none of these: one process, and nothing to set up.

A process that dies must not leave the others waiting. Every wait here has the run's timeout
(`--distributed_timeout`): connecting, the barriers of `barrier`, and the heartbeat by which the
coordination service declares a silent process dead and stops the others. A collective whose peer
died fails at once (its connection closes); `exit_on_error` then ends this process without the
orderly shutdown, which would wait for the dead peer.
"""

import dataclasses
import logging
import os
import sys

import jax

from moejax.errors import ConfigError

log = logging.getLogger("moejax.parallel.distributed")

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "MOEJAX_COORDINATOR", "MOEJAX_NUM_PROCESSES", "MOEJAX_PROCESS_ID")
DEFAULT_TIMEOUT_S = 300
# jax's own default; a longer heartbeat only delays noticing a hung process.
MAX_HEARTBEAT_S = 100


@dataclasses.dataclass(frozen=True)
class Cluster:
  coordinator: str | None  # None: JAX detects it (SLURM)
  num_processes: int | None
  process_id: int | None
  source: str  # "flags", "environment", "slurm"


def _int(value, name: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ConfigError(f"{name}={value!r} must be an integer") from None


def find_cluster(coordinator=None, num_processes=None, process_id=None, environ=None) -> Cluster | None:
  """The multi-process settings in effect, or None for a single process (see the module docstring)."""
  environ = os.environ if environ is None else environ
  given = {"--coordinator": coordinator, "--num_processes": num_processes, "--process_id": process_id}
  source = "flags"
  if all(v is None for v in given.values()):
    given = {ENV_COORDINATOR: environ.get(ENV_COORDINATOR), ENV_NUM_PROCESSES: environ.get(ENV_NUM_PROCESSES),
             ENV_PROCESS_ID: environ.get(ENV_PROCESS_ID)}
    source = "environment"
  if all(v is None for v in given.values()):
    if environ.get("SLURM_JOB_ID") and _int(environ.get("SLURM_NTASKS", "1"), "SLURM_NTASKS") > 1:
      return Cluster(None, None, None, "slurm")
    return None
  missing = [name for name, v in given.items() if v is None]
  if missing:
    raise ConfigError(f"a multi-process run needs all of {', '.join(given)}; missing {', '.join(missing)}")
  address, count, index = given.values()
  count, index = _int(count, list(given)[1]), _int(index, list(given)[2])
  host, _, port = str(address).rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError(f"{list(given)[0]}={address!r} must be HOST:PORT")
  if count < 1 or not 0 <= index < count:
    raise ConfigError(f"process id {index} must be in [0, {count}) processes")
  return Cluster(str(address), count, index, source)


def initialize(coordinator=None, num_processes=None, process_id=None,
               timeout_s: int = DEFAULT_TIMEOUT_S) -> Cluster | None:
  """Connects this process to the others (call before anything touches a device); a no-op for one
  process. CPU processes exchange data through gloo."""
  if timeout_s < 1:
    raise ConfigError(f"--distributed_timeout={timeout_s} must be >= 1 second")
  cluster = find_cluster(coordinator, num_processes, process_id)
  if cluster is None or cluster.num_processes == 1:
    return cluster
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  log.info("process %s of %s: connecting to %s (%s, timeout %d s)", cluster.process_id,
           cluster.num_processes, cluster.coordinator or "the SLURM coordinator", cluster.source, timeout_s)
  jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                             initialization_timeout=timeout_s,
                             heartbeat_timeout_seconds=min(timeout_s, MAX_HEARTBEAT_S),
                             shutdown_timeout_seconds=timeout_s)
  global _timeout_s
  _timeout_s = timeout_s
  return cluster


_timeout_s = DEFAULT_TIMEOUT_S


def is_primary() -> bool:
  """Whether this process writes the run's shared files (process 0)."""
  return jax.process_index() == 0


def _client():
  from jax._src import distributed  # the coordination service client jax.distributed set up

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized in this multi-process run")
  return client


def barrier(name: str, timeout_s: int | None = None) -> None:
  """Waits until every process reaches `name` (a name used once per run); raises after the timeout."""
  if jax.process_count() == 1:
    return
  timeout_s = _timeout_s if timeout_s is None else timeout_s
  try:
    _client().wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)
  except Exception as e:  # noqa: BLE001 - the runtime's error types are not public
    raise TimeoutError(f"process {jax.process_index()} waited {timeout_s} s at {name!r} for the other "
                       f"processes ({type(e).__name__}: {e})") from e


def share(name: str, value: str | None, timeout_s: int | None = None) -> str:
  """Process 0's `value` (a string), on every process: the others wait for it up to the timeout."""
  if jax.process_count() == 1:
    return value
  timeout_s = _timeout_s if timeout_s is None else timeout_s
  key = f"moejax/{name}"
  if is_primary():
    _client().key_value_set(key, value)
    return value
  try:
    return _client().blocking_key_value_get(key, timeout_s * 1000)
  except Exception as e:  # noqa: BLE001
    raise TimeoutError(f"process {jax.process_index()} waited {timeout_s} s for process 0's {name!r} "
                       f"({type(e).__name__}: {e})") from e


def exit_on_error(error: BaseException) -> None:
  """In a multi-process run, ends this process at once after logging `error`: the orderly shutdown
  would wait at a barrier for processes that are dead or stuck in a collective with this one. Its
  peers then see their connections to it close and stop too. One process: returns (raise it)."""
  if jax.process_count() == 1:
    return
  log.error("process %d of %d stops on %s: %s", jax.process_index(), jax.process_count(),
            type(error).__name__, error, exc_info=error)
  for handler in logging.getLogger().handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)
