"""moejax.plan: the planned state bytes per device equal those of the real state sharded on a mesh; the
command's plan of K3 and its one-line errors."""

import json
import math
import types

import jax
import pytest
from jax.sharding import AxisType

from moejax import plan
from moejax.config import load_experiment
from moejax.model import build_model
from moejax.parallel.mesh import MESH_AXES, make_mesh
from moejax.planning import PlanError
from moejax.planning.hardware import Links
from moejax.planning.search import admissible, parse_mesh, prepared
from moejax.training.state import init_state, state_shardings

TINY_MESH = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
# K3 needs a batch that many GPUs can split: 2048 rows of 8192 tokens, 256 rows a pass.
K3_STAGES, K3_MICROBATCH = ((8192, 1000, 2048 * 8192),), 256 * 8192


def _device0_bytes(tree) -> int:
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
             if shard.device == device)


def test_state_bytes_equal_the_real_sharded_state():
  config = load_experiment("experiments/tiny.py")  # AdamW: two moments mirror every parameter
  config.train.mesh.update(TINY_MESH)
  state, _, axes = init_state(build_model(config), config, jax.random.key(0), total_steps=10)
  mesh = make_mesh(**TINY_MESH, axis_types=(AxisType.Auto,) * len(MESH_AXES))
  placed = jax.device_put(state, state_shardings(state, axes, mesh))

  layout = admissible(prepared(config), TINY_MESH)
  assert layout.param_bytes == _device0_bytes(placed.params)
  assert layout.optimizer_bytes == _device0_bytes(placed.opt_state)
  assert layout.other_bytes == _device0_bytes([placed.step, placed.balance, placed.rng, placed.bad_steps])
  # float32 params: the gradients (float32 accumulators) take what the params take
  assert layout.gradient_bytes == layout.param_bytes


def _k3(stages=K3_STAGES, microbatch=K3_MICROBATCH):
  config = load_experiment("experiments/k3.py")
  config.train.stages, config.train.microbatch_tokens = stages, microbatch
  return config


def _last_json(out: str) -> dict:
  return json.loads(out.strip().splitlines()[-1])


def _one_line_exit(excinfo) -> str:
  message = str(excinfo.value.code)
  assert message.startswith("moejax.plan: ") and "\n" not in message
  return message


def _check_memory(result: dict, gpus: int):
  assert math.prod(result["mesh"].values()) == gpus
  assert all(v > 0 for v in result["memory_bytes"].values()), result["memory_bytes"]
  stage = result["stages"][0]
  assert all(v >= 0 for v in stage["activation_bytes"].values()) and stage["activations_total_bytes"] > 0
  assert stage["step_s"] > stage["compute_s"] > 0 and stage["tokens_per_s"] > 0


def test_k3_on_2048_h200(capsys):
  """The search's plan (or, where nothing fits, its smallest mesh's) comes as JSON, then the verdict."""
  try:
    plan.run(_k3(), gpus=2048, gpu="h200")
    verdict = None
  except SystemExit as e:
    verdict = str(e.code)
  result = _last_json(capsys.readouterr().out)
  _check_memory(result, 2048)
  assert result["fits"] == (verdict is None)
  if verdict is not None:
    assert "no mesh of 2048 GPUs fits" in verdict and "GiB over" in verdict and "\n" not in verdict
  assert result["stages"][0]["all_to_all_bytes"]["forward + backward"] > 0


def test_given_mesh_that_fits(capsys):
  """Through main, as the command runs it: a K3 mesh of 4096 H200s."""
  holder = lambda value: types.SimpleNamespace(value=value)
  flags = dict(config=holder(_k3()), gpus=holder(4096), gpu=holder("h200"),
               mesh=holder("fsdp=2,expert=128,tensor=16"), mfu=holder(0.35), nvlink=holder(450.0),
               ib=holder(50.0), node=holder(8))
  plan.main([], flags)
  result = _last_json(capsys.readouterr().out)
  _check_memory(result, 4096)
  assert result["fits"] and result["chosen_by"] == "given"
  assert result["total_bytes"] <= result["usable_bytes"]


def test_no_mesh_of_8_gpus_fits(capsys):
  with pytest.raises(SystemExit) as excinfo:
    plan.run(_k3(stages=((8192, 1, 8192),), microbatch=0), gpus=8, gpu="h200")
  message = _one_line_exit(excinfo)
  assert "no mesh of 8 GPUs fits" in message and "GiB over" in message
  assert not _last_json(capsys.readouterr().out)["fits"]


def test_k3_as_written_has_too_few_rows_for_2048_gpus():
  with pytest.raises(SystemExit) as excinfo:
    plan.run(load_experiment("experiments/k3.py"), gpus=2048, gpu="h200")
  message = _one_line_exit(excinfo)
  assert "divisibility rules" in message and "row shards" in message


def test_bad_meshes():
  with pytest.raises(PlanError, match="has 4 devices, not --gpus=8"):
    parse_mesh("fsdp=2,expert=2", 8)
  with pytest.raises(PlanError, match="'pipeline=2' is not axis=size"):
    parse_mesh("pipeline=2,fsdp=4", 8)
  with pytest.raises(PlanError, match="positive integer"):
    parse_mesh("fsdp=0", 8)
  tiny = load_experiment("experiments/tiny.py")
  tiny.train.stages = ((128, 10, 6 * 128),)  # 6 rows: two data shards times three expert shards
  with pytest.raises(SystemExit) as excinfo:
    plan.run(tiny, gpus=6, gpu="h100", mesh="data=2,expert=3")
  assert "num_experts=8 is not divisible by train.mesh.expert=3" in _one_line_exit(excinfo)
  with pytest.raises(SystemExit) as excinfo:
    plan.run(tiny, gpus=8, gpu="h100", mesh="tensor=8")  # 4 heads cannot split 8 ways
  assert "not divisible" in _one_line_exit(excinfo)


def test_search_on_tiny_picks_a_fitting_mesh(capsys):
  result = plan.run(load_experiment("experiments/tiny.py"), gpus=8, gpu="h100")
  assert result["fits"] and result["chosen_by"] == "search" and result["fitting_meshes"] >= 1
  assert _last_json(capsys.readouterr().out)["mesh"] == result["mesh"]


def test_links_place_the_tensor_axis_within_a_node():
  sizes = {"data": 1, "fsdp": 2, "expert": 64, "tensor": 16}
  links = Links()
  assert links.group(sizes, ("tensor",)) == (16, 8)  # 16 consecutive devices span two nodes
  assert links.group(sizes, ("expert",)) == (64, 1)  # a stride of 16: one per node
  assert links.group({**sizes, "tensor": 4, "expert": 32, "fsdp": 16}, ("tensor",)) == (4, 4)
