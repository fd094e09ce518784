"""The Prometheus exporter: rows in the training loop's format, read back over HTTP as Prometheus would."""

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moejax.training import prometheus
from moejax.training.prometheus import MetricsExporter

LAYERS = ["layer_1/moe", "layers/period_0/layer_3/moe"]  # an unrolled and a scanned model's paths
EXPERTS = 8


def row(step, finite=True, bad_steps=0, **extra):
  """A metrics row as moejax.training.monitor.to_row makes it from the train step's metrics."""
  r = {"step": step, "loss": 3.0 - 0.1 * step, "grad_norm": 0.5, "finite": float(finite),
       "bad_steps": float(bad_steps), "lr": 1e-3, "stage": 0, "seq_len": 128,
       "moe/maxvio_batch": 0.4, "moe/maxvio_global": 0.1, "moe/aux_loss": 0.0}
  for i, layer in enumerate(LAYERS):
    load = [1.0 + 0.1 * (e - 3.5) * (i + 1) + 0.01 * step for e in range(EXPERTS)]
    r[f"moe/{layer}/load"] = load
    r[f"moe/{layer}/maxvio_batch"] = 0.2 * (i + 1) + step
    r[f"moe/{layer}/maxvio_global"] = 0.05 * (i + 1)
    r[f"moe/{layer}/top_share"] = 0.125 * (i + 1)
    r[f"moe/{layer}/load_min"] = min(load)
  return {**r, **extra}


def scrape(port) -> dict:
  """{(sample name, sorted labels): value} of everything the endpoint serves."""
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
    text = response.read().decode()
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels):
  return samples[(name, tuple(sorted({"process": "3", **labels}.items())))]


@pytest.fixture
def exporter():
  e = MetricsExporter(0, process_index=3, addr="127.0.0.1")
  yield e
  e.close()


def test_rows_are_served_with_their_labels(exporter):
  assert exporter.port > 0
  exporter.record(1, row(1))
  exporter.record(2, row(2, tokens_per_s=12_345.0, val_loss=2.5, mfu=0.41))
  exporter.record(3, row(3, finite=False, bad_steps=1, loss=float("nan")))
  exporter.checkpoint_saved(4.25)
  samples = scrape(exporter.port)

  assert value(samples, "moejax_step") == 3
  assert value(samples, "moejax_grad_norm") == 0.5
  assert value(samples, "moejax_loss") != value(samples, "moejax_loss")  # the NaN of the skipped step
  # Evaluation and throughput keep the value of the last step that had them.
  assert value(samples, "moejax_val_loss") == 2.5
  assert value(samples, "moejax_tokens_per_second") == 12_345.0
  assert value(samples, "moejax_mfu") == 0.41
  assert value(samples, "moejax_skipped_steps_total") == 1
  assert value(samples, "moejax_bad_steps") == 1
  assert value(samples, "moejax_checkpoint_save_seconds") == 4.25
  assert value(samples, "moejax_last_step_timestamp_seconds") > 1.7e9

  last = row(3)
  for layer in LAYERS:
    for e in range(EXPERTS):
      assert value(samples, "moejax_expert_load", layer=layer, expert=str(e)) == pytest.approx(
          last[f"moe/{layer}/load"][e])
    assert value(samples, "moejax_moe_maxvio_batch", layer=layer) == last[f"moe/{layer}/maxvio_batch"]
    assert value(samples, "moejax_moe_maxvio_global", layer=layer) == last[f"moe/{layer}/maxvio_global"]
    assert value(samples, "moejax_moe_top_expert_share", layer=layer) == last[f"moe/{layer}/top_share"]

  # Every series has the process label; the means over layers and the keys not exported are absent.
  assert all(dict(labels).get("process") == "3" for _, labels in samples)
  names = {name for name, _ in samples}
  assert names - {"moejax_skipped_steps_created"} == prometheus.METRIC_NAMES
  loads = [labels for name, labels in samples if name == "moejax_expert_load"]
  assert len(loads) == len(LAYERS) * EXPERTS


def test_optional_metrics_have_no_series_until_seen(exporter):
  exporter.record(1, row(1))
  names = {name for name, _ in scrape(exporter.port)}
  assert {"moejax_step", "moejax_loss", "moejax_skipped_steps_total"} <= names
  assert not names & {"moejax_val_loss", "moejax_tokens_per_second", "moejax_mfu",
                      "moejax_checkpoint_save_seconds"}
  assert value(scrape(exporter.port), "moejax_skipped_steps_total") == 0


def test_exporters_are_independent_and_close_frees_the_port():
  a = MetricsExporter(0, process_index=0, addr="127.0.0.1")
  b = MetricsExporter(0, process_index=1, addr="127.0.0.1")
  try:
    a.record(5, row(5))
    b.record(7, row(7))
    assert scrape(a.port)[("moejax_step", (("process", "0"),))] == 5
    assert scrape(b.port)[("moejax_step", (("process", "1"),))] == 7
  finally:
    a.close()
    b.close()
  a.close()  # a second close is harmless
  with pytest.raises(urllib.error.URLError):
    scrape(a.port)
