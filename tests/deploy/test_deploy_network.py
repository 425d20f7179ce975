"""NetworkPolicies: deny by default, allow exactly the service graph, and no way out of the sandboxes.

A small evaluator of Kubernetes NetworkPolicy semantics (a connection needs the source's
egress and the destination's ingress to allow it; a pod no policy selects for a direction is
open in that direction) runs over every rendered overlay. Needs `kubectl`.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("base", "local", "gpu", "gke-tpu")
NAMESPACE = "arlo"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: install it (it bundles kustomize) "
                                "to render deploy/ -- .ci/run does")


@functools.cache
def render(target: str) -> tuple[dict[str, Any], ...]:
    path = ROOT / "deploy" / (target if target == "base" else f"overlays/{target}")
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)  # type: ignore[list-item]
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str = NAMESPACE
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


def component(name: str) -> Pod:
    return Pod(name, labels={"app.kubernetes.io/component": name, "app.kubernetes.io/part-of": "arlo"})


KUBE_DNS = Pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
PROMETHEUS = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
STRANGER = Pod("stranger", "default", {"app.kubernetes.io/component": "rollout"})
"""Same labels as a rollout pod, other namespace: a bare podSelector must not admit it."""
INTERNET = Pod("internet", "")
"""Anything outside the cluster (the cloud metadata server, a package index): only ipBlock reaches it."""


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], pod: Pod, policy_ns: str) -> bool:
    if not pod.namespace:
        return False  # no ipBlock is used by arlo's policies; the outside is never a pod
    ns_labels = {"kubernetes.io/metadata.name": pod.namespace}
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif pod.namespace != policy_ns:
        return False
    return selects(peer.get("podSelector", {}), pod.labels)


def port_matches(rule: dict[str, Any], port: int) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(p.get("port") is None or p["port"] <= port <= p.get("endPort", p["port"]) for p in ports)


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    def direction_ok(pod: Pod, other: Pod, kind: str, rules_key: str, peers_key: str) -> bool:
        if pod.namespace != NAMESPACE:
            return True  # other namespaces: not ours to police
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], pod.labels)
                     and kind in p["spec"].get("policyTypes", ["Ingress"])]
        if not selecting:
            return True
        for policy in selecting:
            for rule in policy["spec"].get(rules_key, []):
                peers = rule.get(peers_key)
                if (not peers or any(peer_matches(peer, other, NAMESPACE) for peer in peers)) and port_matches(rule, port):
                    return True
        return False

    return (direction_ok(src, dst, "Egress", "egress", "to")
            and direction_ok(dst, src, "Ingress", "ingress", "from"))


def policies_of(target: str) -> list[dict[str, Any]]:
    return [d for d in render(target) if d["kind"] == "NetworkPolicy"]


ROLLOUT, INFERENCE, TRAINER, ENV, REWARD, REDIS, OPERATOR = (
    component(n) for n in ("rollout", "inference", "trainer", "env-gateway", "reward", "redis", "operator"))
GRPC = {INFERENCE: 50051, TRAINER: 50052, ENV: 50053, REWARD: 50054, ROLLOUT: 50055}
METRICS = {INFERENCE: 9101, TRAINER: 9102, ENV: 9103, REWARD: 9104, ROLLOUT: 9105}

REQUIRED = [
    (ROLLOUT, INFERENCE, 50051), (ROLLOUT, ENV, 50053), (ROLLOUT, REWARD, 50054), (ROLLOUT, REDIS, 6379),
    (INFERENCE, TRAINER, 50052), (INFERENCE, REDIS, 6379), (TRAINER, REDIS, 6379),
    *[(p, KUBE_DNS, 53) for p in (ROLLOUT, INFERENCE, TRAINER)],
    *[(PROMETHEUS, pod, port) for pod, port in METRICS.items()],
    *[(OPERATOR, pod, port) for pod, port in GRPC.items()], (OPERATOR, REDIS, 6379),
]
"""The service graph (DESIGN.md): rollout drives the others, inference pulls weights from the trainer."""


@pytest.mark.parametrize("target", TARGETS)
def test_default_deny_everything(target: str) -> None:
    deny = [p for p in policies_of(target) if p["spec"]["podSelector"] == {}]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert not deny[0]["spec"].get("ingress") and not deny[0]["spec"].get("egress")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("src, dst, port", REQUIRED, ids=lambda v: v.name if isinstance(v, Pod) else str(v))
def test_the_service_graph_is_allowed(target: str, src: Pod, dst: Pod, port: int) -> None:
    assert allowed(policies_of(target), src, dst, port), f"{target}: {src.name} -> {dst.name}:{port} is blocked"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sandbox", [ENV, REWARD, REDIS], ids=lambda p: p.name)
def test_sandboxes_have_no_way_out(target: str, sandbox: Pod) -> None:
    """env_gateway and reward run model-written code: no DNS, no Redis, no other service, no internet."""
    policies = policies_of(target)
    everything = [ROLLOUT, INFERENCE, TRAINER, ENV, REWARD, REDIS, OPERATOR, KUBE_DNS, PROMETHEUS, INTERNET]
    for dst in everything:
        for port in (53, 80, 443, 6379, 8476, *GRPC.values(), *METRICS.values()):
            if dst != sandbox:
                assert not allowed(policies, sandbox, dst, port), f"{target}: {sandbox.name} -> {dst.name}:{port}"


@pytest.mark.parametrize("target", TARGETS)
def test_edges_outside_the_graph_are_denied(target: str) -> None:
    policies = policies_of(target)
    denied = [
        (ROLLOUT, TRAINER, 50052),  # rollout never calls the trainer
        (INFERENCE, ENV, 50053), (TRAINER, INFERENCE, 50051), (TRAINER, ROLLOUT, 50055),
        (ROLLOUT, INFERENCE, 9101),  # metrics are for Prometheus only
        (STRANGER, INFERENCE, 50051), (STRANGER, REDIS, 6379),  # same labels, other namespace
        (ROLLOUT, INTERNET, 443), (INFERENCE, INTERNET, 443), (TRAINER, INTERNET, 443),
        (PROMETHEUS, INFERENCE, 50051), (PROMETHEUS, REDIS, 6379),
    ]
    for src, dst, port in denied:
        assert not allowed(policies, src, dst, port), f"{target}: {src.name} -> {dst.name}:{port} should be denied"


def test_gke_tpu_trainer_hosts_reach_each_other() -> None:
    """jax.distributed's coordinator (8476) and libtpu's host-to-host ports, between trainer pods only."""
    policies = policies_of("gke-tpu")
    peer = Pod("trainer-1", labels=TRAINER.labels)
    for port in (8476, 8471, 8080, 50052):
        assert allowed(policies, TRAINER, peer, port)
    assert not allowed(policies, INFERENCE, TRAINER, 8476)
    assert not allowed(policies, ENV, TRAINER, 8476)
    assert not allowed(policies_of("base"), TRAINER, peer, 8476)


def test_the_evaluator_blocks_what_a_missing_rule_blocks() -> None:
    """Guards the evaluator: with only default-deny, nothing passes; without policies, all does."""
    deny = [p for p in policies_of("base") if p["metadata"]["name"] == "default-deny-all"]
    assert not allowed(deny, ROLLOUT, INFERENCE, 50051)
    assert allowed([], ROLLOUT, INFERENCE, 50051)
