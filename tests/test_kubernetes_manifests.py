"""The Kubernetes manifests of ``deploy/kubernetes/``: every one validates strictly (no unknown
field) against the API schemas of Kubernetes 1.30 and of the newest release kubernetes-validate
bundles, each kustomization lists exactly its folder's manifests, and the manifests agree with the
code and with each other: the probes ask what the lighthouse serves (never ``lighthouse.store``),
Services, probes and policies name ports the containers have, the network policies select the pods
they are about (managers reach gRPC, operators the dashboard), the trainer's environment is what
``connect()`` reads, and the lighthouse's own command line, run for real with the placeholder
Secrets, answers its probes and takes the trainer's token."""

from __future__ import annotations

import copy
import importlib
import json
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes_validate import utils as kubernetes_validate

from lighthouse.client import LighthouseClient
from lighthouse.store.etcd import parse_store_url
from protos.job_ids import JOB_ENV
from protos.rpc import (
    LIGHTHOUSE_SERVICE,
    LIGHTHOUSE_STORE_HEALTH,
    LIGHTHOUSE_TOKEN_FILE_ENV,
    make_channel,
    parse_address,
    split_addresses,
)
from tests.etcd_cluster import EtcdCluster
from tests.http_util import call
from tests.procs import LighthouseProc, ProcessPool, poll
from worker_client.connect import ENV_LIGHTHOUSE, ENV_RANK, ENV_REPLICA_ID, connect, store_key

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUSTOMIZATION = "kustomization.yaml"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != KUSTOMIZATION)
OLDEST = "1.30"  # the oldest Kubernetes the manifests are for
NEWEST = kubernetes_validate.major_minor(kubernetes_validate.latest_version())
IMAGE = "ghcr.io/example/lighthouse-config:0.1.0"  # the placeholder docs/deploy.md explains
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
TORCHRUN_SETS = {ENV_RANK, "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def everything() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in documents(path)]


def find(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in everything() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def workloads() -> list[dict[str, Any]]:
    return [d for d in everything() if d["kind"] in ("StatefulSet", "Deployment", "Job")]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def ports(workload: dict[str, Any]) -> dict[str, int]:
    """Every container port of the workload's pods by name."""
    return {
        p["name"]: p["containerPort"]
        for c in workload["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def selected(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [w for w in workloads() if selects(selector, pod_labels(w))]


def reached_by(rule: dict[str, Any]) -> set[str]:
    """The workloads of these manifests whose pods an ingress rule lets in."""
    return {
        w["metadata"]["name"]
        for w in workloads()
        for peer in rule["from"]
        if "podSelector" in peer and selects(peer["podSelector"], pod_labels(w))
    }


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def probes(workload: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                yield kind, c[kind]


# ------------------------------------------------------------------ schemas


def test_the_manifests_are_there() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS}
    assert {"lighthouse.yaml", "etcd.yaml", "secrets.yaml", "network-policies.yaml"} <= names, names
    assert "training/trainer.yaml" in names, names


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_every_manifest_validates_strictly(path: Path, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        # The schema of exactly that release (not an older one it fell back to), strict: an unknown
        # or misspelt field fails as the API server's strict field validation would.
        assert kubernetes_validate.validate(doc, version, strict=True) == version, doc["metadata"]


def test_strict_validation_refuses_a_field_1_30_does_not_know() -> None:
    """What the 1.30 run is for: a gRPC probe's ``mode`` (TLS probes) exists only in newer releases."""
    statefulset = copy.deepcopy(find("StatefulSet", "lighthouse"))
    container(statefulset, "lighthouse")["readinessProbe"]["grpc"]["mode"] = "TLS"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, OLDEST, strict=True)
    assert kubernetes_validate.validate(statefulset, NEWEST, strict=True) == NEWEST


def test_each_kustomization_lists_exactly_its_folders_manifests() -> None:
    folders = {p.parent for p in MANIFESTS}
    for folder in folders:
        kustomization = yaml.safe_load((folder / KUSTOMIZATION).read_text())
        assert kustomization["kind"] == "Kustomization"
        assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
        here = {p.name for p in folder.glob("*.yaml") if p.name != KUSTOMIZATION}
        assert sorted(kustomization["resources"]) == sorted(here), folder
        # Namespace-agnostic: applied with -n, nothing names a namespace.
        assert "namespace" not in kustomization
    assert not [d for d in everything() if "namespace" in d["metadata"]]


# ------------------------------------------------------------------ the lighthouse and its probes


def test_the_lighthouse_probes_ask_what_it_serves() -> None:
    statefulset = find("StatefulSet", "lighthouse")
    lighthouse = container(statefulset, "lighthouse")
    assert lighthouse["image"] == IMAGE
    named = ports(statefulset)
    readiness = lighthouse["readinessProbe"]["grpc"]
    # The lighthouse as a whole: "" and its service's name carry the same status.
    assert readiness.get("service", "") in ("", LIGHTHOUSE_SERVICE)
    assert readiness["port"] == named["grpc"]
    for kind in ("livenessProbe", "startupProbe"):
        assert lighthouse[kind]["httpGet"] == {"path": "/healthz", "port": "http"}, kind
    # Never the store's own status, anywhere: it is for alerts, not routing (docs/deploy.md).
    for workload in workloads():
        for kind, probe in probes(workload):
            assert probe.get("grpc", {}).get("service") != LIGHTHOUSE_STORE_HEALTH, (workload, kind)
            assert "exec" not in probe or LIGHTHOUSE_STORE_HEALTH not in json.dumps(probe["exec"])
            port = probe.get("httpGet", {}).get("port")
            assert port is None or port in ports(workload), (workload["metadata"]["name"], kind, port)
    args = lighthouse["args"]
    assert args[:2] == ["lighthouse", "serve"]
    assert parse_address(flag(args, "--bind"))[1] == named["grpc"]
    assert parse_address(flag(args, "--http-bind"))[1] == named["http"]


def test_the_lighthouse_command_line_uses_options_serve_has() -> None:
    from lighthouse.serve.command import serve

    options = {opt for param in serve.params for opt in param.opts}
    args = container(find("StatefulSet", "lighthouse"), "lighthouse")["args"]
    used = {a.split("=", 1)[0] for a in args[2:]}
    assert all(a.startswith("--") for a in used), used
    assert used <= options, used - options


def test_the_lighthouses_store_is_the_etcd_statefulset() -> None:
    etcd = find("StatefulSet", "etcd")
    service = find("Service", etcd["spec"]["serviceName"])
    args = container(find("StatefulSet", "lighthouse"), "lighthouse")["args"]
    url = parse_store_url(flag(args, "--store"))
    members = [f"etcd-{i}.{service['metadata']['name']}" for i in range(etcd["spec"]["replicas"])]
    assert url.endpoints == [f"{m}:{ports(etcd)['client']}" for m in members]
    assert not url.tls
    etcd_args = container(etcd, "etcd")["args"]
    initial = flag(etcd_args, "--initial-cluster").split(",")
    assert initial == [f"{m.split('.')[0]}=http://{m}:{ports(etcd)['peer']}" for m in members]
    assert etcd["spec"]["replicas"] == 3


def test_services_and_disruption_budgets_select_pods_and_ports_they_have() -> None:
    services = [d for d in everything() if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {"lighthouse", "lighthouse-headless", "etcd"}
    for service in services:
        (workload,) = selected({"matchLabels": service["spec"]["selector"]})
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports(workload), (service["metadata"]["name"], port)
            assert port["port"] == ports(workload)[target], (service["metadata"]["name"], port)
    for statefulset in (d for d in workloads() if d["kind"] == "StatefulSet"):
        governing = find("Service", statefulset["spec"]["serviceName"])
        assert governing["spec"]["clusterIP"] == "None"  # per-pod names
        assert selects({"matchLabels": governing["spec"]["selector"]}, pod_labels(statefulset))
        assert selects(statefulset["spec"]["selector"], pod_labels(statefulset))
    budgets = {d["metadata"]["name"]: d for d in everything() if d["kind"] == "PodDisruptionBudget"}
    assert budgets["lighthouse"]["spec"]["minAvailable"] == 1
    assert budgets["etcd"]["spec"]["minAvailable"] == 2  # etcd's quorum of 3
    for budget in budgets.values():
        assert len(selected(budget["spec"]["selector"])) == 1, budget["metadata"]["name"]
    assert find("StatefulSet", "lighthouse")["spec"]["replicas"] == 2


def test_the_network_policies_let_managers_reach_grpc_and_operators_the_dashboard() -> None:
    lighthouse = find("StatefulSet", "lighthouse")
    trainer = find("Job", "trainer")
    etcd = find("StatefulSet", "etcd")
    policy = find("NetworkPolicy", "lighthouse")
    assert selected(policy["spec"]["podSelector"]) == [lighthouse]
    rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(rules) == {"grpc", "http"}
    for rule in policy["spec"]["ingress"]:
        assert len(rule["ports"]) == 1 and rule["ports"][0]["port"] in ports(lighthouse)

    def peers_here(port: str) -> list[dict[str, Any]]:
        """The rule's peers in the policy's own namespace (a podSelector without namespaceSelector)."""
        return [p["podSelector"] for p in rules[port]["from"] if "namespaceSelector" not in p]

    # Managers run in the trainer pods (group rank 0 starts one): every peer of the gRPC rule
    # selects them, in this namespace or in a training namespace, and nothing else.
    assert rules["grpc"]["from"] and all(
        selects(p["podSelector"], pod_labels(trainer)) for p in rules["grpc"]["from"]
    )
    assert not any(selects(p, pod_labels(w)) for p in peers_here("grpc") for w in (lighthouse, etcd))
    # The dashboard: operators, not the managers' pods.
    operator = {"lighthouse-config/access": "operator"}
    assert any(selects(p, operator) for p in peers_here("http"))
    assert not any(selects(p["podSelector"], pod_labels(trainer)) for p in rules["http"]["from"])
    assert not any(selects(p, operator) for p in peers_here("grpc"))
    # etcd: the lighthouses and its members reach the client port, only its members the peer port.
    store = find("NetworkPolicy", "etcd")
    assert selected(store["spec"]["podSelector"]) == [etcd]
    etcd_rules = {rule["ports"][0]["port"]: rule for rule in store["spec"]["ingress"]}
    assert set(etcd_rules) <= set(ports(etcd))
    assert reached_by(etcd_rules["client"]) == {"etcd", "lighthouse"}
    assert reached_by(etcd_rules["peer"]) == {"etcd"}


# ------------------------------------------------------------------ the torchrun job


class _Store:
    """torch's Store as connect() uses it (set, wait, get), in memory: what rank 0 published."""

    def __init__(self, published: dict[str, str]) -> None:
        self.published = published
        self.waited: list[str] = []

    def set(self, key: str, value: str) -> None:
        self.published[key] = value

    def wait(self, keys: list[str], timeout: object) -> None:
        self.waited.extend(keys)
        assert all(k in self.published for k in keys), (keys, self.published)

    def get(self, key: str) -> bytes:
        return self.published[key].encode()


def trainer_env() -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(find("Job", "trainer"), "trainer")["env"]}


def test_the_trainer_environment_is_what_connect_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    job = find("Job", "trainer")
    trainer = container(job, "trainer")
    assert trainer["command"][0] == "torchrun"  # which sets RANK, MASTER_ADDR, MASTER_PORT
    env = trainer_env()
    assert {ENV_LIGHTHOUSE, ENV_REPLICA_ID, JOB_ENV, LIGHTHOUSE_TOKEN_FILE_ENV} <= set(env), set(env)
    assert not TORCHRUN_SETS & set(env), "torchrun sets these itself"
    # One replica group per index of the indexed Job.
    assert job["spec"]["completionMode"] == "Indexed"
    assert env[ENV_REPLICA_ID]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    # The lighthouses by their per-pod names on the headless Service, at their gRPC port.
    lighthouse = find("StatefulSet", "lighthouse")
    headless = lighthouse["spec"]["serviceName"]
    addresses = [parse_address(a) for a in split_addresses(env[ENV_LIGHTHOUSE]["value"])]
    replicas = lighthouse["spec"]["replicas"]
    assert addresses == [(f"lighthouse-{i}.{headless}", ports(lighthouse)["grpc"]) for i in range(replicas)]
    # connect() itself, on a rank that is not 0, with exactly this environment (the completion
    # index as the kubelet fills it in): it finds the address group rank 0 published for its group.
    for name in (ENV_LIGHTHOUSE, ENV_REPLICA_ID, JOB_ENV, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, item in env.items():
        monkeypatch.setenv(name, item.get("value", "1"))
    monkeypatch.setenv(ENV_RANK, "1")
    key = store_key("1", env[JOB_ENV]["value"])
    store = _Store({key: "127.0.0.1:1"})
    connect_module = importlib.import_module("worker_client.connect")
    started = len(connect_module._managers)
    client = connect(store=store, timeout=5)
    try:
        assert client.addr == "127.0.0.1:1"
        assert store.waited == [key]
    finally:
        client.close()
    assert len(connect_module._managers) == started  # rank 1 starts no manager


def test_the_trainers_token_is_a_manager_token_of_its_job() -> None:
    trainer = container(find("Job", "trainer"), "trainer")
    token_path = Path(trainer_env()[LIGHTHOUSE_TOKEN_FILE_ENV]["value"])
    volumes = {v["name"]: v for v in find("Job", "trainer")["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in trainer["volumeMounts"] if token_path.parent == Path(m["mountPath"])]
    secret = find("Secret", volumes[mount["name"]]["secret"]["secretName"])
    token = secret["stringData"][token_path.name]
    tokens = json.loads(find("Secret", "lighthouse-tokens")["stringData"]["manager-tokens.json"])
    assert token in tokens[trainer_env()[JOB_ENV]["value"]]
    # Placeholders, and said to be: nobody mistakes them for real ones.
    for secret in (d for d in everything() if d["kind"] == "Secret"):
        for value in secret["stringData"].values():
            assert "REPLACE-ME" in value, secret["metadata"]["name"]
        source = next(p for p in MANIFESTS if secret in documents(p)).read_text()
        assert "PLACEHOLDER" in source


# ------------------------------------------------------------------ the lighthouse's command line, run


def mounted_secrets(workload: dict[str, Any], name: str, into: Path) -> dict[str, str]:
    """Each secret volume of the container written under ``into`` as the kubelet would mount it:
    its mount path -> the local folder."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    moved = {}
    for mount in container(workload, name)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" not in volume:
            continue
        folder = into / mount["name"]
        folder.mkdir(parents=True)
        for key, value in find("Secret", volume["secret"]["secretName"])["stringData"].items():
            (folder / key).write_text(value)
            (folder / key).chmod(0o600)
        moved[mount["mountPath"]] = str(folder)
    return moved


def check(address: str, service: str) -> str:
    with make_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_the_lighthouse_container_runs_answers_its_probes_and_takes_the_trainers_token(
    procs: ProcessPool, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """``lighthouse serve`` with the StatefulSet's arguments, on loopback ports and the session's
    etcd, its Secrets mounted from secrets.yaml."""
    statefulset = find("StatefulSet", "lighthouse")
    lighthouse = container(statefulset, "lighthouse")
    moved = mounted_secrets(statefulset, "lighthouse", tmp_path)
    local = {
        "--bind": "127.0.0.1:0",
        "--http-bind": "127.0.0.1:0",
        "--store": f"etcd://{etcd1.endpoints}/test-k8s/{uuid.uuid4().hex}",
    }
    args = []
    for arg in lighthouse["args"][1:]:
        name = arg.split("=", 1)[0]
        arg = f"{name}={local[name]}" if name in local else arg
        for mount_path, folder in moved.items():
            arg = arg.replace(mount_path, folder)
        assert "/etc/lighthouse-config" not in arg, arg
        args.append(arg)
    proc: LighthouseProc = procs.spawn(
        [sys.executable, "-m", "lighthouse", *args], "lighthouse", LighthouseProc
    )
    proc.address = proc.readline()
    proc.url = proc.readline()
    # The probes, as the kubelet sends them.
    readiness = lighthouse["readinessProbe"]["grpc"]
    poll(lambda: check(proc.address, readiness.get("service", "")) == "SERVING", 10, what="ready")
    for kind in ("livenessProbe", "startupProbe"):
        assert call(proc.url, "GET", lighthouse[kind]["httpGet"]["path"]).status == 200, kind
    poll(lambda: check(proc.address, LIGHTHOUSE_STORE_HEALTH) == "SERVING", 10, what="the store SERVING")
    # The placeholder tokens work together: the admin edits, the trainer's manager reads.
    admin = find("Secret", "lighthouse-tokens")["stringData"]["admin-token"]
    headers = {"Authorization": f"Bearer {admin}"}
    assert call(proc.url, "PUT", "api/config", {"lr": 0.5}).status == 401
    assert call(proc.url, "PUT", "api/config", {"lr": 0.5}, headers=headers).status == 200
    token = find("Secret", "trainer-lighthouse-token")["stringData"]["token"]
    job = trainer_env()[JOB_ENV]["value"]
    client = LighthouseClient(proc.address, job=job, token=token)
    try:
        assert client.get_config() == {"lr": "0.5"}
    finally:
        client.close()
    stranger = LighthouseClient(proc.address, job=job, token="not-a-token")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stranger.get_config()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    finally:
        stranger.close()
