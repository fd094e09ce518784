"""tools/hlo_traffic.py: the static traffic count of a compiled module, on hand-written HLO."""

import jax
import pytest
from jax.experimental import topologies

from tools import deviceless, hlo_traffic

HLO = """HloModule m

%fused_a (p0: bf16[4,8]) -> (f32[4,8], bf16[4,8]) {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %c = f32[4,8]{1,0} convert(%p0)
  ROOT %t = (f32[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%c, %p0)
}

%fused_b (p1: f32[4,8]) -> f32[4,8] {
  %p1 = f32[4,8]{1,0} parameter(0)
  ROOT %n = f32[4,8]{1,0} negate(%p1)
}

%body (arg: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %arg = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%arg), index=1
  %f = f32[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_b, metadata={op_name="jit(f)/optimizer/neg"}
  ROOT %r = (s32[], f32[4,8]{1,0}) tuple(%i, %f)
}

%cond (arg.1: (s32[], f32[4,8])) -> pred[] {
  %arg.1 = (s32[], f32[4,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %k), direction=LT
}

ENTRY %main (a: bf16[4,8]) -> f32[4,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %fa = (f32[4,8]{1,0}, bf16[4,8]{1,0}) fusion(%a), kind=kLoop, calls=%fused_a, metadata={op_name="jit(f)/transpose(jvp(Transformer))/layer_2/mixer_norm/mul"}
  %g0 = f32[4,8]{1,0} get-tuple-element(%fa), index=0
  %g1 = bf16[4,8]{1,0} get-tuple-element(%fa), index=1
  %b1 = bf16[32]{0} bitcast(%g1)
  %mm = (f32[4,8]{1,0}, s8[64]{0}) custom-call(%g1, %g1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/jvp(Transformer)/layer_2/kda/qkv_conv/dot_general"}
  %g2 = f32[4,8]{1,0} get-tuple-element(%mm), index=0
  %z = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%z, %g0)
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %wout = f32[4,8]{1,0} get-tuple-element(%w), index=1
  %sum = bf16[32]{0} negate(%b1), metadata={op_name="jit(f)/optimizer/neg"}
  ROOT %add = f32[4,8]{1,0} add(%wout, %g2), metadata={op_name="jit(f)/optimizer/add"}
}
"""  # noqa: E501


def test_kernels_are_the_launches_of_the_stream_computations():
  ks, types = hlo_traffic.kernels(HLO)
  by_name = {k.name: k for k in ks}
  # Not the instructions inside fusions, nor views, tuples, constants and the loop itself, nor the
  # condition of a loop whose trip count XLA knows (it does not evaluate it).
  assert set(by_name) == {"fa", "mm", "f", "sum", "add"}
  assert by_name["f"].times == 3 and by_name["fa"].times == 1  # a loop body, per its trip count
  unknown, _ = hlo_traffic.kernels(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
  assert {k.name: k.times for k in unknown if k.name in ("f", "lt")} == {"f": 1, "lt": 1}
  assert [str(a.dtype) for a in by_name["mm"].outputs] == ["f32", "s8"]
  assert types["g1"] == [hlo_traffic.Array("bf16", (4, 8))]


def test_traffic_by_part_direction_and_dtype():
  t = hlo_traffic.traffic(HLO)
  assert t[("pre-norms", "backward", "f32")] == [128, 0]
  assert t[("pre-norms", "backward", "bf16")] == [64, 64]
  # The GEMM reads its operand twice and its s8 workspace is not traffic.
  assert t[("KDA / qkv_conv", "forward", "bf16")] == [0, 128]
  assert t[("KDA / qkv_conv", "forward", "f32")] == [128, 0]
  # The loop body's fusion three times; the entry's add reads two f32 [4,8]; the bitcast's negate bf16.
  assert t[("optimizer update", "", "f32")] == [3 * 128 + 128, 3 * 128 + 256]
  assert t[("optimizer update", "", "bf16")] == [64, 64]


def test_wide_buffers_count_the_reads_of_each_output():
  rows = hlo_traffic.wide_buffers(HLO, min_elements=32)
  reads = {name: n for _, _, _, n, name, _ in rows}
  # fa's float32 output goes only into the loop's carried tuple, which is not followed; the GEMM's is
  # read by the add.
  assert reads == {"fa": 0, "mm": 1, "f": 0, "add": 0}
  assert hlo_traffic.wide_buffers(HLO, min_elements=33) == []


def test_part_totals_and_report():
  once = HLO.replace('"n":"3"', '"n":"1"')
  before, after = hlo_traffic.part_totals(once), hlo_traffic.part_totals(HLO)
  assert after - before == {("optimizer update", ""): 2 * (128 + 128)}
  lines = hlo_traffic.report(HLO, 32, "t", baseline=once)
  assert lines[0] == "## t"
  rows = [line for line in lines if line.startswith("| pre-norms | backward |")]
  # Its row of the traffic table, then of the float32 buffers' (one buffer).
  assert rows == ["| pre-norms | backward | 0.00 | 0.00 | 0.00 | 0.00 |",
                  "| pre-norms | backward | 1 | 0.00 | 0.00 |"]
  assert "Float32 kernel outputs of 32 elements or more: 4, 0.00 GiB written" in "\n".join(lines)
  assert "Against the baseline module (GiB, written + read):" in lines
  # Launches: mixer_norm's fusion and the cuBLAS call once, the loop body's fusion 3 times, the two
  # optimizer ops outside the loop once each (the baseline's loop runs once). The loop's trip count is
  # known, so its condition's compare never runs.
  assert hlo_traffic.launch_counts(HLO) == {
      ("pre-norms", "backward"): 1, ("KDA / qkv_conv", "forward"): 1, ("optimizer update", ""): 5}
  assert "Kernel launches per step: 7." in lines
  assert "| optimizer update |  | 3 | 5 |" in lines and "| **all** | | 5 | 7 |" in lines


CALL_HLO = """HloModule m

%fused_n (p2: f32[256]) -> f32[256] {
  %p2 = f32[256]{0} parameter(0)
  ROOT %n2 = f32[256]{0} negate(%p2)
}

%command_buffer (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %fn = f32[256]{0} fusion(%x), kind=kLoop, calls=%fused_n, metadata={op_name="jit(f)/optimizer/neg"}
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %c0 = f32[256]{0} call(%a), to_apply=%command_buffer
  %c = f32[256]{0} call(%c0), to_apply=%command_buffer
  %cs = (f32[256]{0}, f32[256]{0}, u32[]) copy-start(%c)
  ROOT %cd = f32[256]{0} copy-done(%cs)
}
"""


def test_calls_are_followed_and_async_starts_write_their_result_only():
  """XLA wraps kernel sequences in calls (its command buffers, CUDA graphs, on the GPU), each call a launch
  of its kernels; an async start's type holds its operand too, which it does not write."""
  ks, _ = hlo_traffic.kernels(CALL_HLO)
  assert sorted(k.name for k in ks) == ["cs", "fn", "fn"]  # the computation is called twice
  copy = next(k for k in ks if k.name == "cs")
  assert copy.outputs == [hlo_traffic.Array("f32", (256,))]
  t = hlo_traffic.traffic(CALL_HLO)
  assert t[("optimizer update", "", "f32")] == [2048, 2048]  # the called fusion, twice
  assert t[("other (outside the model and the named parts)", "", "f32")] == [1024, 1024]  # the copy


def test_dtype_bytes():
  assert [hlo_traffic.dtype_bytes(t) for t in ("pred", "bf16", "f32", "s8", "f8e4m3fn", "s4", "c64")] == \
      [1, 2, 4, 1, 1, 1, 8]


def test_deviceless_helpers(monkeypatch):
  real = jax.default_backend()
  with deviceless.gpu_default_backend():
    assert jax.default_backend() == "gpu"
  assert jax.default_backend() == real

  def no_plugin(*args, **kwargs):
    raise NotImplementedError("topology not implemented for cuda")

  monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
  with pytest.raises(SystemExit, match="needs the CUDA PJRT plugin"):  # a clear exit, not a traceback
    deviceless.h200_devices()
  assert "core_count: 132" in deviceless.TARGET.read_text()


PTXAS_LOG = """ptxas warning : Registers are spilled to local memory in function 'kda_prep_fwd', 16 bytes spill stores
ptxas info    : Compiling entry function 'kda_prep_fwd' for 'sm_90a'
ptxas info    : Function properties for kda_prep_fwd
    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas warning : Registers are spilled to local memory in function 'kda_prep_bwd', 4 bytes spill stores
ptxas info    : Compiling entry function 'kda_scan_fwd_mosaic_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kda_scan_fwd_mosaic_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 146 registers, used 2 barriers, 1 bytes smem
"""  # noqa: E501


def test_ptxas_reports_and_register_bound_occupancy():
  kernels = deviceless.ptxas_kernels(PTXAS_LOG)
  assert kernels == {"kda_prep_fwd": {"registers": 255, "spill_stores": 16, "spill_loads": 12},
                     "kda_scan_fwd_mosaic_mosaic_gpu_kernel": {"registers": 146, "spill_stores": 0,
                                                               "spill_loads": 0}}
  # 64K registers per SM, allocated per warp in units of 256 (8 per thread), whole 4-warp blocks.
  assert [deviceless.warps_per_sm(r, 4) for r in (255, 168, 146, 128, 32)] == [8, 12, 12, 16, 64]
  assert deviceless.warps_per_sm(178, 8) == 8 and deviceless.warps_per_sm(168, 2) == 12
