"""The replica deployment in deploy/: the Kubernetes manifests pass kubernetes-validate (strict, the
`dev` extra installs it), the compose file runs several replicas behind the nginx balancer with
health checks, and every metric of a named replica carries its replica label."""

from __future__ import annotations

import pathlib

import pytest

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"
yaml = pytest.importorskip("yaml")


def test_kubernetes_manifests_validate():
    kv = pytest.importorskip("kubernetes_validate")
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)  # raises on any schema error or unknown field
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    service = next(d for d in docs if d["kind"] == "Service")
    assert deploy["spec"]["replicas"] >= 2
    pod = deploy["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "--replica-name" in c["args"] and c["ports"][0]["containerPort"] == 8000
    assert service["spec"]["selector"] == pod["metadata"]["labels"]


def test_compose_runs_replicas_behind_the_balancer():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    app, lb = compose["services"]["dspark"], compose["services"]["balancer"]
    assert app["deploy"]["replicas"] >= 2 and "/health" in " ".join(app["healthcheck"]["test"])
    assert "--replica-name" in " ".join(app["command"]) and app["restart"] == "unless-stopped"
    assert lb["depends_on"]["dspark"]["condition"] == "service_healthy" and lb["ports"] == ["8000:8000"]
    conf = (DEPLOY / "nginx.conf").read_text()
    assert "server dspark:8000 resolve" in conf and "proxy_buffering off" in conf


def test_a_named_replica_labels_every_metric():
    from prometheus_client.parser import text_string_to_metric_families

    from dspark.server.metrics import ServerMetrics

    text = ServerMetrics("m", replica="pod-7").render().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert samples and all(s.labels.get("replica") == "pod-7" for s in samples)
    plain = ServerMetrics("m").render().decode()
    assert 'replica="' not in plain
