"""The benchmarks' own arithmetic: the step's FLOP count and synthetic batches, the attention
benchmark's pair count (the timing itself runs on the GPU, never in a test)."""

import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from benchmarks import attention, kda, step_setup
from benchmarks.flops import (
  causal_attention_forward_flops_per_token,
  kda_forward_flops_per_token,
  visible_keys_per_query,
)
from moejax.model import build_model
from moejax.params import count_params

H200 = str(pathlib.Path(__file__).resolve().parents[2] / "experiments" / "h200.py")


def abstract_params(config):
  """(params, logical axes) of the config's model, as shapes: what the FLOP and matrix counts read."""
  from moejax.training.state import logical_axes

  model = build_model(config)
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 16), np.int32)))
  return nn.unbox(abstract["params"]), logical_axes(abstract["params"])


@pytest.mark.parametrize("scan", [False, True])
def test_matmul_flops_are_six_per_active_weight(scan):
  """3 x (2 per active matmul weight): the parameter counter's active total less the embedding table
  (a gather) and the vectors (norm scales, AttnRes queries), which do no matmul work per token; the
  same with scanned layers, whose stacked vectors have a leading layers axis."""
  config = step_setup.load_config(H200, [f"model.scan_layers={scan}", "model.num_layers=12"], smoke=True)
  params, _ = abstract_params(config)
  stacked = lambda path: str(getattr(path[0], "key", "")) == "scanned"
  vectors = sum(leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
                if leaf.ndim - stacked(path) < 2)
  embedding = params["embedding"].size
  # Two rows: one document of 256, and documents of 100, 100 and 56.
  segment_ids = np.array([[0] * 256, [0] * 100 + [1] * 100 + [2] * 56])
  flops = step_setup.model_flops_per_token(config, params, segment_ids)
  assert flops["matmul weights"] == pytest.approx(6 * (count_params(config)["active"] - embedding - vectors))
  m = config.model
  assert flops["KDA chunked form"] == pytest.approx(3 * 9 * kda_forward_flops_per_token(
      m.kda.num_heads, m.kda.head_k_dim, m.kda.head_v_dim, m.kda.chunk_size))  # 9 KDA layers
  pairs = 256 * 257 / 2 + 2 * 100 * 101 / 2 + 56 * 57 / 2  # causal (query, key) pairs within documents
  assert flops["MLA attention"] == pytest.approx(3 * 3 * causal_attention_forward_flops_per_token(
      m.mla.num_heads, m.mla.qk_nope_head_dim, m.mla.v_head_dim, pairs / 512))
  assert flops["total"] == pytest.approx(sum(v for k, v in flops.items() if k != "total"))


def test_flop_formulas_by_hand():
  # one head, C=2, K=V=1: per chunk 2*4 + 4*2 + 6*2 + 4 = 32, per token 16
  assert kda_forward_flops_per_token(1, 1, 1, 2) == 16
  # 2 keys per query on average; 2 FLOPs per multiply-add over (qk + v) = 2 widths
  assert causal_attention_forward_flops_per_token(1, 1, 1, 2) == 2 * 2 * 2
  # One row of 3 tokens: (3 + 1) / 2 keys a query. Documents [2, 1] and [1, 1, 1] with a repeated id
  # (a document starts where the id changes): 3 + 1 pairs and 1 + 1 + 1 pairs over 6 queries.
  assert visible_keys_per_query(np.array([[5, 5, 5]])) == 2
  assert visible_keys_per_query(np.array([[0, 0, 1], [3, 4, 3]])) == (4 + 3) / 6


def test_synthetic_batch_is_packed_documents():
  config = step_setup.load_config(H200, ["model.moe.top_k=3", "model.remat=full"], smoke=True)
  assert config.model.moe.top_k == 3 and config.model.remat == "full"  # overrides come after the shrink
  b = step_setup.synthetic_batch(config, 2, 512, mean_doc=50)
  seg = np.asarray(b["segment_ids"])
  assert seg.shape == (2, 512) and seg.min() >= 1 and np.all(np.diff(seg, axis=1) >= 0)
  assert 3 < len(np.unique(seg[0])) < 60  # about 512 / 50 documents
  np.testing.assert_array_equal(np.asarray(b["tokens"])[:, 1:], np.asarray(b["targets"])[:, :-1])
  assert int(np.asarray(b["tokens"]).max()) < config.model.vocab_size


def test_attention_pair_count_and_documents():
  seg = np.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
  assert attention.pair_count(seg) == (6 + 3 + 1) + 21
  docs = attention.segments(2, 5000, 100, seed=0)
  assert (np.diff(docs, axis=1) >= 0).all()
  lengths = np.diff(np.flatnonzero(np.diff(np.r_[-1, docs[0], -2])))
  assert lengths.sum() == 5000 and 50 < lengths.mean() < 200


def test_newton_schulz_flops_by_hand_and_matrix_list():
  from benchmarks.flops import newton_schulz_flops
  # m=3 <= n=5: X X^T 2*9*5, A A 2*27, B X 2*9*5 per step; 5 steps; a batch of 2.
  assert newton_schulz_flops([(2, 5, 3)]) == 2 * 5 * (4 * 9 * 5 + 2 * 27)
  # The symmetric X X^T and A A as lower triangles: half of each.
  assert newton_schulz_flops([(2, 5, 3)], symmetric=True) == 2 * 5 * (9 * 5 + 27 + 2 * 9 * 5)
  config = step_setup.load_config(H200, [], smoke=True)
  params, axes = abstract_params(config)
  matrices = step_setup.muon_matrices(config, params, axes)
  # Every expert matrix is one entry per expert; the router, embedding, head and vectors are not there.
  m = config.model
  assert (m.moe.num_experts, m.moe.latent_dim, m.moe.expert_hidden_dim) in matrices
  assert (1, m.d_model, m.moe.num_experts) not in matrices
  adamw = step_setup.load_config(H200, ["optim.name=adamw"], smoke=True)
  assert not step_setup.muon_matrices(adamw, params, axes)


def test_newton_schulz_benchmark_smoke():
  """`newton_schulz.py --smoke` on the CPU (interpret mode): the whole update's two rows with errors of
  bf16 size against float32 (a wrong kernel would be of order 1), and one row per group whose matrices
  add up to step.py's count of Muon's matrices."""
  root = pathlib.Path(__file__).resolve().parents[2]
  out = subprocess.run([sys.executable, "-m", "benchmarks.newton_schulz", "--smoke"],
                       capture_output=True, text=True, timeout=600, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  # The section as printed at the end (its rows were printed once before, as they came).
  lines = lines[max(i for i, line in enumerate(lines) if line.startswith("The whole Muon update")):]
  update = [line for line in lines if line.startswith(("| xla |", "| ours |"))]
  assert len(update) == 2 and all(float(line.split("|")[-2]) < 0.1 for line in update), out.stdout
  config = step_setup.load_config(H200, [], smoke=True)
  matrices = step_setup.muon_matrices(config, *abstract_params(config))
  groups = [line for line in lines if line.startswith("| ") and " x " in line.split("|")[1]
            and line.split("|")[1].strip()[0].isdigit()]
  assert sum(int(line.split("|")[1].split(" x ")[0]) for line in groups) == sum(b for b, _, _ in matrices)
  # each group's times: xla, ours, xla/ours, ours with P at X X^T's blocks; then their sums
  assert all(len(line.split("|")) == 7 for line in groups), groups
  (total,) = [line.split("|") for line in lines if line.startswith("| sum |")]
  for col in (2, 3, 5):
    column = [float(line.split("|")[col]) for line in groups]
    assert float(total[col]) == pytest.approx(sum(column), abs=1e-3 * len(groups))  # rows rounded


@pytest.mark.parametrize("row", [0, 15, 16, 47, 99])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_kda_finiteness_check_sees_every_slab(row, bad):
  """The T=1M check reduces by slabs of rows (the last one overlapping the one before): a NaN or Inf
  anywhere, the slab edges and the ragged end included, makes it fail."""
  x = jax.numpy.ones((1, 100, 2, 8), jax.numpy.bfloat16)
  assert kda._finite(x, slab=16)
  assert not kda._finite(x.at[0, row, 1, 3].set(bad), slab=16)


def test_kda_section_is_replaced_in_place(tmp_path):
  """--section-out swaps the KDA section of a markdown file and keeps the sections around it apart."""
  path = tmp_path / "B.md"
  path.write_text("# Benchmarks\n\n## A\n\na\n\n## KDA kernel\n\nold\n\n## C\n\nc\n")
  kda.write_section(str(path), "## KDA kernel\n\nnew\n")
  assert path.read_text() == "# Benchmarks\n\n## A\n\na\n\n## KDA kernel\n\nnew\n\n## C\n\nc\n"
  kda.write_section(str(tmp_path / "new.md"), "## KDA kernel\n\nx\n")
  assert (tmp_path / "new.md").read_text() == "# Benchmarks\n\n## KDA kernel\n\nx\n"


def test_fla_tune_cache_is_one_folder_per_gpu_model(tmp_path):
  """fla's autotuning results are kept per GPU model (Triton keys them by sm_90 for the H100 and the H200
  alike), and counted by their `cache_results` files wherever Triton's hashed folders put them."""
  h100 = kda.fla_tune_dir(str(tmp_path), "NVIDIA H100 80GB HBM3")
  h200 = kda.fla_tune_dir(str(tmp_path), "NVIDIA H200")
  assert h100 == tmp_path / "NVIDIA_H100_80GB_HBM3" and h200 == tmp_path / "NVIDIA_H200"
  assert kda.autotune_results(h100) == 0  # not made yet
  for i, name in enumerate(["chunk_kda_fwd_kernel.autotune.json", "other.autotune.json", "kernel.cubin"]):
    (h100 / f"hash{i}").mkdir(parents=True)
    (h100 / f"hash{i}" / name).write_text("{}")
  assert kda.autotune_results(h100) == 2 and kda.autotune_results(h200) == 0


def test_kda_stress_run_end_to_end():
  """`kda.py --stress-only --stress-heads` at the smoke shapes (interpret mode): the T=1M run's path."""
  root = pathlib.Path(__file__).resolve().parents[2]
  out = subprocess.run([sys.executable, "-m", "benchmarks.kda", "--smoke", "--stress-only",
                        "--stress-heads", "1"], capture_output=True, text=True, timeout=300, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  assert ("(B=1 H=1 D=32, chunk 32): forward alone finite: True; forward and backward finite: True"
          in out.stdout)


def test_step_benchmark_on_a_mesh_times_components_on_one_devices_rows():
  """`step.py --smoke --mesh data=2` on 2 of 8 CPU devices, 4 rows in 2 passes (h200.py accumulates,
  and so does its smoke config): the step runs on the mesh, and the components, timed alone on one
  device, get that device's share of one pass's rows (1 of 4), counted once a pass (the optimizer once
  a step), so that their times compare with the step's."""
  root = pathlib.Path(__file__).resolve().parents[2]
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-m", "benchmarks.step", "--smoke", "--only", "step",
                        "--mesh", "data=2", "--mean-doc", "30"], capture_output=True, text=True, timeout=600,
                       cwd=root, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "mesh data=2: step" in out.stderr + out.stdout
  assert "(4 rows; 2 passes of 512 tokens each)" in out.stdout
  assert "one device's rows of one of its 2 passes, 1 of 4; counts per step):" in out.stdout
  assert "| optimizer update | 1 |" in out.stdout and "| LM head + loss | 2 |" in out.stdout


def test_situ_glu_benchmark_smoke():
  """`situ_glu.py --smoke` on the CPU: its three rows and the errors against float64, which at bf16 inputs
  and outputs are bf16 rounding (a wrong form or gradient would show errors of order 1)."""
  root = pathlib.Path(__file__).resolve().parents[2]
  out = subprocess.run([sys.executable, "-m", "benchmarks.situ_glu", "--smoke"],
                       capture_output=True, text=True, timeout=300, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line for line in out.stdout.splitlines() if line.startswith(("| moejax", "| formula"))]
  assert len(rows) == 2, out.stdout
  for row in rows:
    errs = [float(x) for x in row.split("|")[-2].split("/")]
    assert len(errs) == 3 and max(errs) < 1e-2, row


def test_quantile_benchmark_smoke():
  """`quantile.py --smoke --sweep` on the CPU (interpret mode): every table row bit-equal to XLA, and
  every swept block shape runs and agrees."""
  root = pathlib.Path(__file__).resolve().parents[2]
  out = subprocess.run([sys.executable, "-m", "benchmarks.quantile", "--smoke", "--sweep"],
                       capture_output=True, text=True, timeout=300, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [line for line in out.stdout.splitlines() if line.startswith("| [300, 24] |")]
  assert len(rows) == 4 and all(row.endswith("| True |") for row in rows), out.stdout
  swept = [line for line in out.stdout.splitlines() if line.startswith(("  threshold", "  margins"))]
  assert swept and all(line.endswith("equal True") for line in swept), out.stdout


def test_publish_writes_the_section_with_its_provenance(tmp_path, monkeypatch, capsys):
  from benchmarks.report import provenance, publish

  monkeypatch.setattr(sys, "argv", ["/somewhere/benchmarks/situ_glu.py", "--out", "B.md"])
  # A copy of the tree run elsewhere names its commit, whatever .git came along.
  monkeypatch.setenv("MOEJAX_COMMIT", "0123456789abcdef0123")
  assert provenance("Some GPU")[1].endswith("commit: 0123456789ab.")
  monkeypatch.delenv("MOEJAX_COMMIT")
  lines = [*provenance("Some GPU"), "| a | b |"]
  assert lines[0] == "Command: `python -m benchmarks.situ_glu --out B.md`  "
  stamp = r"Date: 20\d\d-\d\d-\d\d, device: Some GPU, commit: ([0-9a-f]{12}(\+changes)?|unknown)\."
  assert re.fullmatch(stamp, lines[1]), lines[1]
  path = tmp_path / "B.md"
  path.write_text("# Benchmarks\n\n## T\n\nold\n\n## U\n\nu\n")
  publish(str(path), "T", lines)
  assert path.read_text() == "# Benchmarks\n\n## T\n\n" + "\n".join(lines) + "\n\n## U\n\nu\n"
  publish(None, "T", lines)
  assert capsys.readouterr().out.count("| a | b |") == 2


def test_vision_benchmark_smoke():
  """`vision.py --smoke` on the CPU: the text-only and the vision step in one table, images and encoder
  FLOPs on the vision row only (the run itself checks that each row's placeholders match its image tokens
  and that the decoder's count leaves the tower out); and the encoder's count by hand."""
  from types import SimpleNamespace

  from benchmarks.vision import encoder_flops

  # Images of 4 and 8 patches, width 2, depth 3, merge 2: 10 tower and 5 projector weights.
  f = encoder_flops(SimpleNamespace(width=2, depth=3, merge=2),
                    {"tower kernels": 10, "projector kernels": 5}, [4, 8])
  assert f["tower matmuls"] == 3 * 2 * 10 * 12 and f["projector"] == 3 * 2 * 5 * 3
  assert f["tower attention"] == 3 * 3 * 4 * (16 + 64) * 2
  root = pathlib.Path(__file__).resolve().parents[2]
  out = subprocess.run([sys.executable, "-m", "benchmarks.vision", "--smoke"], capture_output=True, text=True,
                       timeout=900, cwd=root)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
          for line in out.stdout.splitlines() if line.startswith(("| text-only |", "| vision |"))}
  assert set(rows) == {"text-only", "vision"}, out.stdout
  # step ms, tokens/s (all), tokens/s (text), images/s, decoder TFLOP, encoder TFLOP, MFU x 2, time / text
  number = lambda cell: float(cell.replace(",", "").rstrip("%"))
  text, vision = rows["text-only"], rows["vision"]
  assert len(text) == len(vision) == 9
  assert text[3] == "-" and text[5] == "-" and text[8] == "1.00" and text[1] == text[2]
  assert number(vision[3]) > 0 and number(vision[5]) > 0 and number(vision[8]) > 0
  assert number(vision[2]) < number(vision[1])  # image positions are not text
  assert "wrote the" not in out.stdout  # --smoke writes no table
