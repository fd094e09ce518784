"""Session-wide test setup: 8 virtual CPU devices for the mesh tests, set before JAX starts."""

import hashlib
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs (the tiny model's steps, the same shapes in several tests and in
# the subprocesses some of them start): XLA's persistent cache, shared by the workers and subprocesses of
# a run (they inherit the environment) and kept between runs of this checkout, compiles each once.
_checkout = hashlib.sha256(os.path.dirname(os.path.abspath(__file__)).encode()).hexdigest()[:12]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"moejax-test-xla-cache-{_checkout}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # bytes; the oldest entries go
# The tests' programs are small and run once or a few times: compiling them is most of the suite's time,
# and XLA's CPU backend compiles them faster with LLVM's optimisation off; the programs compute the same
# functions (the HLO passes all run).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                    "--xla_llvm_disable_expensive_passes=true"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The suite's longest tests (their durations on a 2-core machine, longest first), started first: with two
# workers, a long test that starts last leaves the other worker idle to its end. pyproject's addopts hands
# the tests out one at a time (--maxschedchunk=1), so this order is the order the workers take them in.
LONGEST_FIRST = (
    "tests/rl/test_loop.py::test_three_iterations_update_the_policy_and_resume_bit_exactly",
    "tests/test_notebooks.py::test_rl_notebook_runs",
    "tests/test_notebooks.py::test_quickstart_then_generate_and_long_context_notebooks_run",
    "tests/parallel/test_multiprocess.py::test_two_processes_train_as_one_process_with_two_devices",
    "tests/model/test_scan_layers.py::test_scanned_equals_unrolled_forward_and_gradients",
    "tests/tools/test_benchmarks.py::test_vision_benchmark_smoke",
    "tests/training/test_microbatches.py::test_passes_with_scanned_layers_accumulate_stacked_experts",
    "tests/test_notebooks.py::test_vision_notebook_runs",
    "tests/tools/test_benchmarks.py::test_newton_schulz_benchmark_smoke",
    "tests/tools/test_benchmarks.py::test_step_benchmark_on_a_mesh_times_components_on_one_devices_rows",
    "tests/storage/test_object_storage.py::test_train_into_s3_kill_and_resume",
    "tests/training/test_quickstart.py::test_readme_quickstart_trains_resumes_and_reads_well",
    "tests/moe/test_expert_parallel.py::test_train_step_on_a_data_x_expert_mesh_matches_one_device",
    "tests/model/test_scan_layers.py::test_train_step_scanned_equals_unrolled",
    "tests/parallel/test_multiprocess.py::test_metrics_endpoints_and_a_killed_process_stops_the_other",
)


def pytest_collection_modifyitems(config, items):
  def rank(item):
    for i, prefix in enumerate(LONGEST_FIRST):
      if item.nodeid.startswith(prefix):
        return i
    return len(LONGEST_FIRST)

  items.sort(key=rank)  # stable: the rest keep their order
