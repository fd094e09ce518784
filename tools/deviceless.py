"""Compiling for an H200 on a machine that has none: XLA's deviceless GPU compilation.

The CUDA PJRT plugin builds a compile-only device from a target description (h200_target.txtpb: the
SM count, memory, bandwidth and compute capability that XLA's cost models read) instead of a GPU. What
comes out is the GPU compiler's own HLO: its fusions, its cuBLAS calls, its buffer assignment and memory
plan. With no device XLA skips autotuning, so GEMM algorithms and the Triton GEMMs' tiles are defaults;
step.py's XLA flags turn the Triton GEMMs off, so its GEMMs are cuBLAS calls here as there.

The CPU machines lack the plugin. Install it in an environment of its own that also sees the project's
packages (the plugin makes JAX look for a GPU, which the test suite must not do):

  python3.13 -m venv /tmp/gpuvenv
  /tmp/gpuvenv/bin/pip install jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
  echo "$PWD/.venv/lib/python3.13/site-packages" > /tmp/gpuvenv/lib/python3.13/site-packages/project.pth
  JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python -m tools.hlo_traffic --deviceless ...

Triton and Mosaic GPU kernels are compiled too, which needs `ptxas` on the PATH (CUDA 13). Two more
differences from a compile on the GPU: sorts use XLA's own algorithm, as XLA lacks the CUB scratch sizes
of a device it has not seen (it says so in a warning), and the Triton kernels' tiles are not autotuned.
"""

import contextlib
import os
import pathlib
import re
import shutil
import tempfile

TARGET = pathlib.Path(__file__).with_name("h200_target.txtpb")


def use_step_flags() -> None:
  """step.py's XLA flags, as its H200 runs set them; call before JAX starts its backends."""
  from benchmarks.step import XLA_FLAGS

  os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), XLA_FLAGS]))


def verbose_ptxas() -> pathlib.Path:
  """Has every ptxas run of this process (XLA's, for its Triton and Pallas Triton kernels, and Mosaic
  GPU's) report registers and spills to the returned log, through a `ptxas -v` wrapper put first on the
  PATH. Call before JAX starts its backends: it also turns XLA's in-process PTX compiler off."""
  real = shutil.which("ptxas")
  if real is None:
    raise SystemExit("ptxas is not on the PATH (CUDA 13's, for sm_90a)")
  where = pathlib.Path(tempfile.mkdtemp(prefix="ptxas_v_"))
  log = where / "ptxas.log"
  log.touch()
  wrapper = where / "ptxas"
  # Each run's report goes to a file of its own and into the log whole, under a lock, once ptxas is done:
  # runs at the same time must not interleave, and a reader must not find half a report.
  wrapper.write_text(f"""#!/usr/bin/env bash
out=$(mktemp)
"{real}" -v "$@" 2>"$out"
rc=$?
cat "$out" >&2
{{ flock 9; cat "$out" >> "{log}"; }} 9>>"{log}"
rm -f "$out"
exit $rc
""")
  wrapper.chmod(0o755)
  os.environ["PATH"] = f"{where}{os.pathsep}{os.environ['PATH']}"
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_libnvptxcompiler=false".strip()
  return log


_ENTRY = re.compile(r"Compiling entry function '([\w.$]+)'")


def ptxas_kernels(log_text: str) -> dict[str, dict]:
  """{kernel: {"registers", "spill_stores", "spill_loads"}} from `ptxas -v` output (the last report of
  each kernel name)."""
  out = {}
  starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(log_text)] + [(len(log_text), None)]
  for (begin, name), (end, _) in zip(starts, starts[1:], strict=False):
    part = log_text[begin:end]
    regs = re.search(r"Used (\d+) registers", part)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
    if regs:
      out[name] = {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)) if spill else 0,
                   "spill_loads": int(spill.group(2)) if spill else 0}
  return out


def warps_per_sm(registers: int, warps_per_block: int) -> int:
  """The warps an H100/H200 SM can hold of a kernel with this many registers per thread and warps per
  block, before any other limit: 64K registers, allocated per warp in units of 256 (per thread in 8s),
  and whole blocks only, at most 64 warps."""
  per_warp = -(-registers // 8) * 8 * 32
  return min(64 // warps_per_block, 65536 // (per_warp * warps_per_block)) * warps_per_block


def h200_devices() -> list:
  """One compile-only H200 (a jax Device that jit can compile for, never run on)."""
  from jax.experimental import topologies

  try:
    topo = topologies.get_topology_desc("h200", "cuda", target_config=TARGET.read_text(), topology="1x1x1")
  except (NotImplementedError, RuntimeError) as e:
    raise SystemExit(f"deviceless compilation needs the CUDA PJRT plugin (tools/deviceless.py says "
                     f"how to install it): {e}") from e
  return list(topo.devices)


def h200_sharding():
  """A replicated sharding on a one-H200 mesh with step.py's axes, for abstract step arguments."""
  import jax

  from moejax.parallel import mesh as meshlib

  mesh = meshlib.make_mesh(devices=h200_devices(),
                           axis_types=(jax.sharding.AxisType.Auto,) * len(meshlib.MESH_AXES))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@contextlib.contextmanager
def gpu_default_backend():
  """While tracing for the compile-only H200 the process's default backend is still the CPU, and the
  kernels choose their implementation by it (Pallas on "gpu", XLA elsewhere): they are told "gpu"."""
  import jax

  real = jax.default_backend
  jax.default_backend = lambda: "gpu"
  try:
    yield
  finally:
    jax.default_backend = real
