"""The Kubernetes manifests: every overlay renders, validates strictly, and agrees with the code.

Needs `kubectl` (kustomize is built in) and `kubernetes-validate` (dev extra); no cluster.
The cross-checks read the run config out of each rendered ConfigMap with arlo.config's own
loader, so a port, host or env var that drifts from what the services read fails here.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from arlo.config import RunConfig, load_config
from arlo.distributed import detect

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("local", "gpu", "gke-tpu")
TARGETS = ("base", *OVERLAYS)
SERVICES = {"inference": "inference", "trainer": "trainer", "env_gateway": "env-gateway", "reward": "reward",
            "rollout": "rollout"}
"""config section -> Kubernetes name (Service, workload, app.kubernetes.io/component label)."""
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "JobSet")
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
"""Labels the JobSet and Job controllers put on each pod: together they name JAX process 0."""
EXTERNAL_SECRETS = {"arlo-auth"}
"""Secrets the operator creates (`kubectl create secret`, docs/deploy.md) unless an overlay generates them."""
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: install it (it bundles kustomize) "
                                   "to render deploy/ -- .ci/run does")


@functools.cache
def render(target: str) -> tuple[dict[str, Any], ...]:
    path = DEPLOY / target if target == "base" else DEPLOY / "overlays" / target
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)  # type: ignore[list-item]
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def of_kind(docs: tuple[dict[str, Any], ...], *kinds: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in kinds]


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    if workload["kind"] == "JobSet":
        (rjob,) = workload["spec"]["replicatedJobs"]
        return rjob["template"]["spec"]["template"]
    return workload["spec"]["template"]


def pod_templates(docs: tuple[dict[str, Any], ...]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{w['kind']}/{w['metadata']['name']}", pod_template(w)) for w in of_kind(docs, *WORKLOAD_KINDS)]


def run_config(docs: tuple[dict[str, Any], ...], tmp_path: Path) -> RunConfig:
    (cm,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("arlo-config")]
    path = tmp_path / "run.yaml"
    path.write_text(cm["data"]["run.yaml"])
    return load_config(path)


def workload_for(docs: tuple[dict[str, Any], ...], component: str) -> dict[str, Any]:
    found = [w for w in of_kind(docs, *WORKLOAD_KINDS)
             if pod_template(w)["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one workload for {component}, found {[w['metadata']['name'] for w in found]}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40}


def quantity(value: str | int) -> float:
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert match and match.group(2) in _UNITS, f"cannot parse quantity {value!r}"
    return float(match.group(1)) * _UNITS[match.group(2)]


# --- rendering and schema validation ----------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_renders(target: str) -> None:
    kinds = {d["kind"] for d in render(target)}
    assert {"Namespace", "ConfigMap", "Service", "Deployment", "NetworkPolicy"} <= kinds


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) or shutil.which("kubernetes-validate")
    if exe is None:
        pytest.fail("kubernetes-validate not found; install the dev extra (pip install -e '.[dev]')")
    return subprocess.run([exe, "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=300)


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.timeout(360)
def test_kubernetes_validate_strict(target: str, tmp_path: Path) -> None:
    """Every object against the current Kubernetes schemas, unknown fields rejected; only the
    JobSet (a CRD: checked in test_gke_tpu_trainer_is_a_jobset_across_the_slice) has no schema."""
    path = tmp_path / f"{target}.yaml"
    path.write_text(yaml.safe_dump_all(render(target)))
    result = _validate(path)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and "ERROR" not in out, out
    warnings = [line for line in out.splitlines() if line.startswith("WARN")]
    assert all("kind JobSet" in w for w in warnings), warnings


@pytest.mark.timeout(360)
def test_the_validator_rejects_unknown_fields(tmp_path: Path) -> None:
    """Guards the test above: strict mode must fail a misspelt field."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"replicas": 1, "replica": 2, "selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = _validate(path)
    assert result.returncode != 0 and "'replica' was unexpected" in result.stdout + result.stderr


# --- cross-checks against the code ------------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_every_service_runs_as_the_config_says(target: str, tmp_path: Path) -> None:
    docs = render(target)
    cfg = run_config(docs, tmp_path)
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    for section, name in SERVICES.items():
        server = getattr(cfg, section).server
        where = f"{target}: {name}"
        # Clients dial the headless Service; the pod binds 0.0.0.0 (deploy/entrypoint.py).
        assert server.address == f"dns:///{name}:{server.port}", where
        svc = services[name]
        # Headless: clients balance over pod addresses themselves (env_gateway per episode).
        assert svc["spec"]["clusterIP"] == "None", f"{where}: Service must be headless for client-side LB"
        assert "sessionAffinity" not in svc["spec"], f"{where}: affinity is the client's job (env_affinity.py)"
        selector = dict(svc["spec"]["selector"])
        if section == "trainer" and workload_for(docs, name)["kind"] == "JobSet":
            # Only process 0 serves arlo.v1.Trainer; the other hosts serve health only.
            assert selector.pop(JOB_INDEX_LABEL) == "0" and selector.pop(COMPLETION_INDEX_LABEL) == "0", where
        assert selector == {"app.kubernetes.io/component": name}, where
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": server.port,
                                                                        "metrics": server.metrics_port}, where

        workload = workload_for(docs, name)
        pod = pod_template(workload)
        (container,) = pod["spec"]["containers"]
        # The image's entry point takes the service as its first argument.
        assert container["args"][0].replace("-", "_") == section, where
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == server.port and ports["metrics"] == server.metrics_port, where
        annotations = pod["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == str(server.metrics_port), where

        env = env_of(container)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        config_volume = next(n for n, v in volumes.items() if v.get("configMap", {}).get("name", "").startswith("arlo-config"))
        assert env["ARLO_CONFIG"]["value"] == f"{mounts[config_volume]}/run.yaml", where
        assert env["ARLO_BIND_HOST"]["value"] == "0.0.0.0", where
        token = env[cfg.auth.token_env]["valueFrom"]["secretKeyRef"]
        assert token["name"].startswith("arlo-auth") and token["key"] == "token", where
        if section in ("trainer", "inference"):
            assert env["ARLO_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where
        assert pod["spec"]["terminationGracePeriodSeconds"] > server.grace_s, f"{where}: grace period"
        if section == "trainer":
            assert cfg.trainer.checkpoint_dir in mounts.values(), f"{where}: checkpoint_dir must be a mounted volume"


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_every_probe_asks_a_port_that_serves_health(target: str, tmp_path: Path) -> None:
    docs = render(target)
    cfg = run_config(docs, tmp_path)
    health_ports = {getattr(cfg, s).server.port for s in SERVICES}
    for where, pod in pod_templates(docs):
        for c in pod["spec"]["containers"]:
            if c["name"] == "cli":
                continue
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                assert probe is not None, f"{target} {where}: no {kind}"
                if c["name"] == "redis":
                    assert "exec" in probe or "tcpSocket" in probe
                    continue
                # kubelet's grpc probe takes a number, not a port name, and sends no auth.
                port = probe["grpc"]["port"]
                assert isinstance(port, int) and port in health_ports, f"{target} {where} {kind}: {port}"
                assert port == next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc"), f"{target} {where}"


def _code_text() -> str:
    files = [*ROOT.joinpath("arlo").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py"),
             *DEPLOY.glob("*.py")]
    return "\n".join(p.read_text() for p in files if "proto" not in p.parts)


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_env_var_names_are_ones_the_code_reads(target: str) -> None:
    code = _code_text()
    jax_reads = {"JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "HOME"}  # read by JAX/XLA/Python
    for where, pod in pod_templates(render(target)):
        for c in pod["spec"]["containers"]:
            for name in env_of(c):
                if c["name"] == "redis" or name in jax_reads:
                    continue
                assert f'"{name}"' in code, f"{target} {where}: ${name} is read by no code in arlo/, services/, deploy/"


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_references_resolve_to_rendered_objects(target: str) -> None:
    """ConfigMaps, Secrets, PVCs and service accounts a pod names exist (catches a CRD whose
    references kustomize did not rewrite to the generated, hashed names)."""
    docs = render(target)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    claim_templates = {t["metadata"]["name"] for w in of_kind(docs, "StatefulSet")
                       for t in w["spec"].get("volumeClaimTemplates", [])}
    for where, pod in pod_templates(docs):
        spec = pod["spec"]
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in names, f"{target} {where}"
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names, f"{target} {where}: {v}"
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, f"{target} {where}"
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in {v["name"] for v in spec.get("volumes", [])} | claim_templates, f"{target} {where}"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in names or ref["name"] in EXTERNAL_SECRETS, f"{target} {where}: {ref}"


# --- security, resources, availability --------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_pods_are_restricted(target: str) -> None:
    docs = render(target)
    (ns,) = of_kind(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for where, pod in pod_templates(docs):
        spec = pod["spec"]
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, f"{target} {where}"
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, f"{target} {where}"
        assert spec["automountServiceAccountToken"] is False, f"{target} {where}"
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), f"{target} {where}"
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, f"{target} {where}"
            assert sc["readOnlyRootFilesystem"] is True, f"{target} {where}"
            assert sc["capabilities"] == {"drop": ["ALL"]}, f"{target} {where}"
            assert not sc.get("privileged"), f"{target} {where}"
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), f"{target} {where}: writable /tmp"
            assert ":" in c["image"] and not c["image"].endswith(":latest"), f"{target} {where}: pin the image tag"


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_resources_are_requested_and_limited(target: str) -> None:
    for where, pod in pod_templates(render(target)):
        for c in pod["spec"]["containers"]:
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            for key in ("cpu", "memory"):
                assert quantity(requests[key]) <= quantity(limits[key]), f"{target} {where}: {key}"
            for key in set(requests) | set(limits):
                if "/" in key:  # accelerators: Kubernetes requires requests == limits
                    assert requests.get(key) == limits.get(key), f"{target} {where}: {key}"
        for v in pod["spec"].get("volumes", []):
            if "emptyDir" in v:
                assert "sizeLimit" in v["emptyDir"], f"{target} {where}: unbounded emptyDir {v['name']}"


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_redis_maxmemory_fits_its_limit_and_never_evicts(target: str) -> None:
    redis = workload_for(render(target), "redis")
    (c,) = pod_template(redis)["spec"]["containers"]
    args = c["args"]
    maxmemory = quantity(args[args.index("--maxmemory") + 1].replace("mb", "Mi").replace("gb", "Gi"))
    assert maxmemory < 0.8 * quantity(c["resources"]["limits"]["memory"]), f"{target}: room for the AOF rewrite fork"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_autoscalers_and_disruption_budgets(target: str) -> None:
    docs = render(target)
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"env-gateway", "reward", "rollout"}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment" and name in deployments
        assert "replicas" not in deployments[name]["spec"], f"{target}: {name} replicas would fight the HPA"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pod_labels = [pod["metadata"]["labels"] for _, pod in pod_templates(docs)]
    pdbs = of_kind(docs, "PodDisruptionBudget")
    assert {p["metadata"]["name"] for p in pdbs} == {"inference", "env-gateway", "reward", "rollout"}
    for pdb in pdbs:
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), f"{target}: {pdb['metadata']['name']}"


# --- overlays ---------------------------------------------------------------------------------

@needs_kubectl
def test_local_overlay_is_cpu_only_and_self_contained() -> None:
    docs = render("local")
    assert any(d["metadata"]["name"].startswith("arlo-auth") for d in of_kind(docs, "Secret"))
    for where, pod in pod_templates(docs):
        for c in pod["spec"]["containers"]:
            assert not any("/" in k for k in c["resources"]["limits"]), f"{where}: accelerator in local"
            if c["name"] in SERVICES.values():
                assert env_of(c)["JAX_PLATFORMS"]["value"] == "cpu"
    assert workload_for(docs, "operator")["metadata"]["name"] == "arlo-cli"


@needs_kubectl
def test_gpu_overlay_gives_inference_and_trainer_a_gpu() -> None:
    docs = render("gpu")
    for name in ("inference", "trainer"):
        pod = pod_template(workload_for(docs, name))
        (c,) = pod["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert workload_for(docs, "trainer")["kind"] == "StatefulSet"


JOBSET_KEYS = {  # jobset.x-k8s.io/v1alpha2 (api/jobset/v1alpha2/jobset_types.go)
    "spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
             "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"},
    "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
    "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
    "replicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
}
TPU_CHIPS = {"tpu-v5-lite-podslice": 4}
"""Chips per host of the multi-host machine types the overlay uses (v5e: ct5lp-hightpu-4t)."""


@needs_kubectl
@pytest.mark.timeout(360)
def test_gke_tpu_trainer_is_a_jobset_across_the_slice(tmp_path: Path) -> None:
    docs = render("gke-tpu")
    assert not [s for s in of_kind(docs, "StatefulSet") if s["metadata"]["name"] == "trainer"]
    jobset = workload_for(docs, "trainer")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    spec = jobset["spec"]
    assert set(spec) <= JOBSET_KEYS["spec"]
    assert set(spec.get("network", {})) <= JOBSET_KEYS["network"]
    assert set(spec.get("failurePolicy", {})) <= JOBSET_KEYS["failurePolicy"]
    (rjob,) = spec["replicatedJobs"]
    assert set(rjob) <= JOBSET_KEYS["replicatedJob"]
    assert spec["network"].get("enableDNSHostnames", True) and spec["network"].get("publishNotReadyAddresses", True)

    # The Job template is a batch/v1 Job spec: validate it as one, strictly.
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer-slice-worker-0", "namespace": "arlo"},
           "spec": rjob["template"]["spec"]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = _validate(path)
    assert result.returncode == 0 and "ERROR" not in result.stdout, result.stdout + result.stderr

    job_spec = rjob["template"]["spec"]
    hosts = job_spec["parallelism"]
    assert job_spec["completions"] == hosts and job_spec["completionMode"] == "Indexed"
    pod = job_spec["template"]["spec"]
    selector = pod["nodeSelector"]
    accelerator, topology = selector["cloud.google.com/gke-tpu-accelerator"], selector["cloud.google.com/gke-tpu-topology"]
    chips = 1
    for dim in topology.split("x"):
        chips *= int(dim)
    (c,) = pod["containers"]
    assert int(c["resources"]["limits"]["google.com/tpu"]) == TPU_CHIPS[accelerator] == chips // hosts

    # What arlo.distributed reads: one process per host, process 0 = pod 0 of job 0.
    env = {k: v["value"] for k, v in env_of(c).items() if "value" in v}
    processes = hosts * rjob.get("replicas", 1)
    assert env["JAX_NUM_PROCESSES"] == str(processes)
    subdomain = spec.get("network", {}).get("subdomain") or jobset["metadata"]["name"]
    host0 = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{subdomain}"
    assert env["JAX_COORDINATOR_ADDRESS"].split(":")[0] == host0
    assert env["JAX_PROCESSES_PER_JOB"] == str(hosts)
    job_index = env_of(c)["JOBSET_JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert job_index == f"metadata.labels['{JOB_INDEX_LABEL}']"
    # Every (job, pod) of the JobSet, as many Jobs as it would have with more slices: distinct ids.
    for replicas in (rjob.get("replicas", 1), 2):
        scaled = {**env, "JAX_NUM_PROCESSES": str(hosts * replicas)}
        ids = []
        for job in range(replicas):
            for index in range(hosts):
                found = detect({**scaled, "JOBSET_JOB_INDEX": str(job), "JOB_COMPLETION_INDEX": str(index)})
                assert found is not None and found.num_processes == hosts * replicas
                ids.append(found.process_id)
        assert ids == list(range(hosts * replicas))


@needs_kubectl
def test_gke_tpu_inference_and_gvisor() -> None:
    docs = render("gke-tpu")
    pod = pod_template(workload_for(docs, "inference"))
    assert {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} <= set(pod["spec"]["nodeSelector"])
    assert "google.com/tpu" in pod["spec"]["containers"][0]["resources"]["limits"]
    assert pod_template(workload_for(docs, "env-gateway"))["spec"]["runtimeClassName"] == "gvisor"
    for target in ("base", "local", "gpu"):
        assert "runtimeClassName" not in pod_template(workload_for(render(target), "env-gateway"))["spec"]
