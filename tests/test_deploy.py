"""deploy/: the JobSet renderer, the Prometheus rules and scrape config, the Grafana dashboard and the
Dockerfile, checked against each other and against the exporter's metric names."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.k8s import render
from moejax.training.prometheus import METRIC_NAMES

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
ARGS = dict(hosts=4, image="registry.example.com/moejax:v1", config="experiments/h200.py",
            workdir="s3://bucket/run")


def pod_of(jobset: dict) -> tuple[dict, dict, dict]:
  """(replicated job, its Job spec, its single container) of a rendered JobSet."""
  [rjob] = jobset["spec"]["replicatedJobs"]
  job = rjob["template"]["spec"]
  [container] = job["template"]["spec"]["containers"]
  return rjob, job, container


def test_jobset_for_four_hosts():
  text = render.render(**ARGS)
  jobset = yaml.safe_load(text)
  assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
  name = jobset["metadata"]["name"]
  assert jobset["spec"]["network"]["enableDNSHostnames"] is True
  assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
  rjob, job, container = pod_of(jobset)
  assert rjob["replicas"] == 1
  assert job["parallelism"] == job["completions"] == 4
  assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
  assert job["template"]["spec"]["restartPolicy"] == "Never"
  assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 8

  env = {e["name"]: e for e in container["env"]}
  assert set(env) >= {"MOEJAX_COORDINATOR", "MOEJAX_NUM_PROCESSES", "MOEJAX_PROCESS_ID"}
  # Process 0's pod: <jobset>-<replicated job>-<job index 0>-<pod index 0>.<headless service = jobset>
  assert env["MOEJAX_COORDINATOR"]["value"] == f"{name}-{rjob['name']}-0-0.{name}:1234"
  assert env["MOEJAX_NUM_PROCESSES"]["value"] == "4"
  assert env["MOEJAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
      "metadata.annotations['batch.kubernetes.io/job-completion-index']")

  assert container["image"] == ARGS["image"]
  assert container["command"] + container["args"] == [
      "python", "-m", "moejax.train", "--config", "experiments/h200.py", "--workdir", "s3://bucket/run",
      "--config.train.metrics_port=9090"]
  ports = {p["name"]: p["containerPort"] for p in container["ports"]}
  assert ports == {"coordinator": 1234, "metrics": 9090}
  annotations = job["template"]["metadata"]["annotations"]
  assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9090"


def test_jobset_options_and_extra_args():
  jobset = yaml.safe_load(render.render(**{**ARGS, "hosts": 1}, name="k3-run", gpus_per_host=4, port=5555,
                                        metrics_port=8000, max_restarts=0,
                                        extra_args=["--config.train.steps=10"]))
  rjob, job, container = pod_of(jobset)
  assert jobset["metadata"]["name"] == "k3-run" and jobset["spec"]["failurePolicy"]["maxRestarts"] == 0
  assert job["parallelism"] == job["completions"] == 1
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
  env = {e["name"]: e.get("value") for e in container["env"]}
  assert env["MOEJAX_COORDINATOR"] == f"k3-run-{rjob['name']}-0-0.k3-run:5555"
  assert container["args"][-2:] == ["--config.train.metrics_port=8000", "--config.train.steps=10"]


@pytest.mark.parametrize("change, message", [
    (dict(hosts=0), "hosts"), (dict(hosts=-2), "hosts"), (dict(hosts="4"), "hosts"),
    (dict(hosts=True), "hosts"),
    (dict(name="Moejax"), "DNS-1035"), (dict(name="1run"), "DNS-1035"), (dict(name="run-"), "DNS-1035"),
    (dict(name="run_a"), "DNS-1035"), (dict(name="r" * 60), "63"),
    (dict(port=9090), "differ"), (dict(port=70000), "port"), (dict(gpus_per_host=0), "gpus_per_host"),
    (dict(workdir="runs/h200"), "workdir"), (dict(image="my image"), "image"), (dict(config=""), "config"),
])
def test_bad_inputs_are_refused(change, message):
  with pytest.raises(ValueError, match=message):
    render.render(**{**ARGS, **change})


def test_cli(capsys):
  render.main(["--hosts", "2", "--image", "img:1", "--config", "experiments/tiny.py", "--workdir",
               "gs://b/r", "--name", "tiny", "--", "--config.train.steps=5"])
  jobset = yaml.safe_load(capsys.readouterr().out)
  assert jobset["metadata"]["name"] == "tiny" and pod_of(jobset)[1]["completions"] == 2
  assert pod_of(jobset)[2]["args"][-1] == "--config.train.steps=5"
  with pytest.raises(SystemExit) as e:
    render.main(["--hosts", "0", "--image", "i", "--config", "c", "--workdir", "gs://b/r"])
  assert e.value.code == 2 and "hosts must be" in capsys.readouterr().err


def test_runs_as_a_module():
  out = subprocess.run([sys.executable, "-m", "deploy.k8s.render", *sum(
      ([f"--{k}", str(v)] for k, v in ARGS.items()), [])], capture_output=True, text=True, check=True,
      cwd=DEPLOY.parent).stdout
  assert yaml.safe_load(out)["kind"] == "JobSet"


def metric_names(expr: str) -> set[str]:
  return set(re.findall(r"\bmoejax_[a-zA-Z0-9_:]*", expr))


def test_alert_rules_use_exported_metrics():
  rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
  [group] = rules["groups"]
  assert group["name"] == "moejax"
  by_name = {rule["alert"]: rule for rule in group["rules"]}
  assert set(by_name) == {"ExpertCollapse", "SkippedSteps", "ThroughputDrop", "NoProgress"}
  for name, rule in by_name.items():
    assert rule["expr"] and rule["for"] and rule["labels"]["severity"] in {"warning", "critical"}, name
    assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    used = metric_names(rule["expr"])
    assert used and used <= METRIC_NAMES, (name, used - METRIC_NAMES)


def test_prometheus_config_loads_the_rules():
  config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
  assert config["rule_files"] == ["alerts.yml"]
  assert {job["job_name"] for job in config["scrape_configs"]} >= {"moejax"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_rules_and_each_alert_fires_on_its_series():
  """alerts_test.yml: each alert quiet on a healthy series and firing, with its labels and text, on a
  bad one (a layer collapsing, a streak of skipped steps, throughput halved, steps stopping)."""
  subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")], check=True,
                 capture_output=True)
  subprocess.run(["promtool", "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml")], check=True,
                 capture_output=True)


def test_the_alert_tests_cover_every_alert():
  rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
  tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())
  alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
  fired = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if case["exp_alerts"]}
  assert fired == alerts


def test_dashboard_queries_use_exported_metrics():
  dashboard = json.loads((DEPLOY / "grafana" / "moejax.json").read_text())
  variables = {v["name"]: v for v in dashboard["templating"]["list"]}
  assert {"process", "layer"} <= set(variables)
  assert variables["layer"]["query"] == "label_values(moejax_expert_load, layer)"
  exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
  queries = exprs + [v["query"] for v in variables.values() if v["type"] == "query"]
  for query in queries:
    used = metric_names(query)
    assert used and used <= METRIC_NAMES, (query, used - METRIC_NAMES)
  assert all('process=~"$process"' in expr for expr in exprs)
  # Every exported metric is on the dashboard, and the expert loads as a heatmap of the chosen layer.
  assert set().union(*map(metric_names, exprs)) == METRIC_NAMES - {"moejax_last_step_timestamp_seconds"}
  [heatmap] = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
  [target] = heatmap["targets"]
  assert "moejax_expert_load" in target["expr"] and 'layer="$layer"' in target["expr"]
  assert target["legendFormat"] == "{{expert}}"


def test_dockerfile():
  text = (DEPLOY / "Dockerfile").read_text()
  assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M) and "nvidia/cuda:13." in text
  assert re.search(r"pip install .*\"\.\[gpu\]\"", text)
  entrypoint = re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)
  assert json.loads(entrypoint) == ["python", "-m", "moejax.train"]
