"""tools/trace_parts.py and tools/memory_plan.py: name stacks to model parts, HLO metadata,
and both tools end to end on the CPU at tiny shapes."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tools import memory_plan, trace_parts

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("op_name, expected", [
    ("jit(train_step)/jvp(Transformer)/layer_5/moe/router/dot_general", ("MoE / router", "forward")),
    ("jit(train_step)/transpose(jvp(Transformer))/layer_0/kda/chunk_kda/jit(_kda)/pallas_call",
     ("KDA / chunk_kda", "backward")),
    ("jit(train_step)/jvp(Transformer)/layer_1/moe/shared_0/gate/dot_general", ("MoE / shared_0", "forward")),
    ("jit(train_step)/transpose(jvp(Transformer))/layer_3/mla/while/body/dot_general", ("MLA", "backward")),
    ("jit(train_step)/jvp(Transformer)/layer_2/ffn_attnres/mul", ("AttnRes", "forward")),
    ("jit(train_step)/jvp(Transformer)/layer_2/add", ("layer glue (residual adds, casts)", "forward")),
    ("jit(train_step)/transpose(jvp(lm_head_loss))/while/body/dot_general", ("LM head + loss", "backward")),
    ("jit(train_step)/optimizer/mul", ("optimizer update", "")),
    ("state.opt_state[1].mu['layer_0']", ("copies of the step's arguments", "")),
    ("jit(train_step)/jvp(Transformer)/jit(_take)/gather",
     ("model, outside the layers (embedding, final AttnRes)", "forward")),
    ("jit(loss)/transpose(jvp(MoE))/grouped_glu/jit(_gmm)/tgmm", ("MoE / grouped_glu", "backward")),
    ("jit(train_step)/select_n", ("other (outside the model and the named parts)", "")),
])
def test_model_part(op_name, expected):
  assert trace_parts.model_part(op_name) == expected


def test_op_names_inherit_from_called_computation_and_operand():
  hlo = """HloModule m

%fused_computation.1 (p0: f32[2]) -> f32[2] {
  %p0 = f32[2]{0} parameter(0)
  %neg.0 = f32[2]{0} negate(%p0), metadata={op_name="jit(f)/layer_3/moe/combine/neg"}
  ROOT %tanh.1 = f32[2]{0} tanh(%neg.0), metadata={op_name="jit(f)/layer_3/moe/router/tanh"}
}

ENTRY %main.5 (Arg_0.1: f32[2]) -> f32[2] {
  %Arg_0.1 = f32[2]{0} parameter(0)
  %fusion.1 = f32[2]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.1
  %copy.2 = f32[2]{0} copy(%fusion.1)
  ROOT %add.3 = f32[2]{0} add(%copy.2, %copy.2), metadata={op_name="jit(f)/optimizer/add"}
}
"""
  names = trace_parts.op_names(hlo)
  assert names["fusion.1"] == "jit(f)/layer_3/moe/router/tanh"  # the root's, not the first op's
  assert names["copy.2"] == names["fusion.1"]
  assert names["add.3"] == "jit(f)/optimizer/add"
  assert "Arg_0.1" not in names


def test_trace_charges_kernels_to_their_parts(tmp_path):
  def loss(w, x):
    with jax.named_scope("layer_3"), jax.named_scope("moe"):
      with jax.named_scope("router"):
        h = jnp.tanh(x @ w)
      with jax.named_scope("combine"):
        h = jnp.sin(h @ w.T)
    return jnp.sum(h**2)

  def step(w, x):
    g = jax.grad(loss)(w, x)
    with jax.named_scope("optimizer"):
      w = w - 0.1 * g / (jnp.linalg.norm(g) + 1.0)
    return w, {"g": jnp.sum(g)}

  w, x = jnp.ones((64, 32)) * 0.01, jnp.ones((128, 64))
  compiled = jax.jit(step).lower(w, x).compile()
  events, w = trace_parts.trace_steps(compiled, w, x, calls=2, log_dir=str(tmp_path))
  assert events and w.shape == (64, 32)
  charged = trace_parts.attribute(events, trace_parts.op_names(compiled.as_text()))["parts"]
  for key in [("MoE / router", "forward"), ("MoE / router", "backward"), ("MoE / combine", "forward"),
              ("optimizer update", "")]:
    assert charged[key] > 0, (key, charged)
  # Nearly every kernel is attributed to some named op.
  assert charged[("unattributed kernels", "")] <= 0.1 * sum(charged.values())
  lines = trace_parts.table(events, trace_parts.op_names(compiled.as_text()), calls=2, wall_ms=1.0)
  assert any(line.startswith("| MoE / router |") for line in lines)


def test_memory_plan_peak_of_a_moe_layer(tmp_path):
  out = subprocess.run([sys.executable, "-m", "tools.memory_plan", "--smoke",
                        "--seq-len", "256", "--parts", "moe", "--dump", str(tmp_path), "--top", "5"],
                       capture_output=True, text=True, check=True, cwd=ROOT,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}).stdout
  assert "moe: temporaries" in out
  assert "Buffers live at the peak" in out
  assert "| MoE / grouped_glu (forward) |" in out or "| MoE / grouped_glu (backward) |" in out


def test_fusion_bodies_show_what_a_costly_kernel_computes():
  """The profile's fusions.txt: for each costly op (not a library call), its instruction and the fused
  computation it calls, from a real compiled module; cheap ops and custom calls are left out."""
  import jax
  import jax.numpy as jnp

  compiled = jax.jit(lambda x: jnp.tanh(x * 3.0).sum(axis=0) + 1.0).lower(jnp.ones((64, 32))).compile()
  text = compiled.as_text()
  fusions = [n for n, lines in trace_parts.computations(text).items() if "tanh" in "".join(lines[1:])]
  callers = [m.group(1) for line in text.splitlines() if (m := trace_parts._INSTRUCTION.match(line))
             and any(f"calls=%{f}" in line or f"calls={f}" in line for f in fusions)]
  assert callers, text
  rows = [(callers[0], 0.5, "MoE / router", "forward", "jit(f)/tanh"),
          ("custom-call.7", 9.0, "MoE / grouped_glu", "forward", "jit(f)/dot_general"),
          ("cheap.3", 0.01, "other", "", "")]
  out = trace_parts.fusion_bodies(text, rows, min_ms=0.1)
  joined = "\n".join(out)
  assert f"== {callers[0]}: 0.500 ms per call, MoE / router forward" in joined
  assert "tanh(" in joined and "metadata=" not in joined
  assert "custom-call.7" not in joined and "cheap.3" not in joined
  missing = trace_parts.fusion_bodies(text, [("gone.1", 1.0, "other", "", "")], min_ms=0.1)
  assert missing[-1].strip() == "(not in this module)"


def test_peak_buffers_parse_the_live_range_dump(tmp_path):
  (tmp_path / "module_0001.jit_train_step.gpu_after_optimizations-live-range.txt").write_text(
      "HloLiveRange (max 5):\n  Live ranges at 4 (peak):\n"
      "    a.1{}: 1048576 bytes (cumulative: 1048576 bytes)\n"
      "    fusion.2{0}: 4194304 bytes (cumulative: 5242880 bytes)\n  Stack trace breakdown\n")
  assert memory_plan.peak_buffers(str(tmp_path), "train_step") == [("fusion.2", 4194304), ("a.1", 1048576)]
  assert memory_plan.peak_buffers(str(tmp_path), "loss") == []


def test_peak_table_names_what_an_unnamed_fusion_makes():
  """A buffer whose op has no name is shown by the result type of the instruction that made it (the
  1M step's zero-filled scan buffers were found that way)."""
  hlo = ("ENTRY %main {\n"
         "  %loop_broadcast_fusion.5 = (f32[8,16]{1,0}, f32[8,16]{1,0}, /*index=2*/f32[8,16]{1,0}) fusion(), "
         "kind=kLoop, calls=%fused_broadcast.5\n"
         "  ROOT %add.1 = bf16[4,2]{1,0} add(%p, %q), metadata={op_name=\"jit(f)/layer_0/add\"}\n}\n")
  types = memory_plan.result_types(hlo)
  assert types["loop_broadcast_fusion.5"] == "3 x f32[8,16]" and types["add.1"] == "bf16[4,2]"
  lines = memory_plan.peak_table([("loop_broadcast_fusion.5", 3 * 512), ("add.1", 16)],
                                 trace_parts.op_names(hlo), 5, types)
  assert any("(no op name; makes 3 x f32[8,16])" in line for line in lines)
  assert any("jit(f)/layer_0/add" in line for line in lines)
