"""`tonearm train CONFIG --plan … --emit-k8s`: the multi-node Kubernetes Job of k8s/train-multinode,
sized by the plan of the cluster given (docs/deploy.md, "Training Job: from the plan").

A renderer above the plan it renders (:mod:`training.data.cluster_plan` never imports it): the
dry run that prints both is :func:`training.launch.cli_plan`.

**What a pod may ask for** (:func:`pod_cluster`): a node's *allocatable* CPU and memory, not its
capacity — the kubelet keeps some for the system and Kubernetes, and DaemonSets' pods take their
requests out of the rest, so a pod requesting the whole capacity is never scheduled.
``--allocatable-per-node cpu=…,memory=…`` gives what a pod may have on the node (``kubectl describe
node``: Allocatable less the DaemonSets' requests); without it the Job asks for
:func:`default_allocatable` — GKE's published reservation formula below the capacity
(``--cores-per-node``, ``--memory-per-node``) and :data:`DAEMONSET_CPU` / :data:`DAEMONSET_MEMORY` for
DaemonSets — and the plan is made for that pod, not for the whole node.

The plan (:func:`training.data.cluster_plan.plan_for`, of the pod's share) → the Job, per pod
(one pod = one node):

* ``cpu`` requests = limits = the pod's whole cores (a CPU limit sets the cgroup quota, so
  ``data.num_workers: auto`` inside the pod sees these cores, not the whole machine's), and
  ``data.num_workers`` is passed explicitly as the plan's workers per rank;
* ``memory`` requests = limits = the pod's memory: what the plan sized the shuffle buffers from
  (``data.shuffle_buffer: auto`` takes a share of the memory the pod is given, its cgroup limit)
  and checked everything it counts against (loader, processes, caches, knowledge-base copies: at most
  :data:`~training.data.cluster_plan.HOST_HEADROOM` of it) — the /dev/shm volume's pages are charged
  to it too, and the plan's host figure already holds the batches in flight;
* the ``shm`` volume's ``sizeLimit`` = the plan's /dev/shm per node × :data:`SHM_MARGIN`, rounded
  up to a GiB; a run checks /dev/shm against its own layout at start and refuses one too small;
* ``nvidia.com/gpu`` = ``--gpus-per-node``; ``completions`` = ``parallelism`` = ``--nodes``;
* the config travels **inside the rendered objects**: a ConfigMap (:data:`CONFIG_MAP`) holds the
  config file as the renderer read it (its ``extends`` chain resolved: one self-contained file),
  mounted at :data:`CONFIG_PATH` — the pod never depends on a path typed where the Job was rendered;
* ``--process-baseline FILE`` (a calibration of ``python -m training.memory_calibration``) travels the
  same way: the file as read, under :data:`BASELINE_KEY` in that ConfigMap, and
  ``TONEARM_PROCESS_BASELINE`` = :data:`BASELINE_PATH` in the container, so the pods' node check at
  start counts the processes as the plan did; without the option the Job has neither (the pods use the
  default figure);
* the other overrides given travel in ``EXTRA``, each one shell word (``shlex``), and the script
  splits them with ``eval "set -- $EXTRA"`` under ``set -f``: ``data.languages=[eng,fra]`` reaches
  ``tonearm train`` as typed, never as a glob of the pod's working directory;
* pod 0 exports ``best/`` at the end only when ``CATALOGUE`` names a JSONL manifest of the
  catalogue's audio (``tonearm export --data`` reads a manifest, not shards): rendered empty, so a
  bucket-only run ends after training with a line saying how to export.

Failure policy (training/fatal.py): a deterministic failure (``DataError``, ``ConfigError``, a
refused plan) makes the pod exit :data:`training.fatal.FATAL_EXIT`, which ``podFailurePolicy``
marks ``FailJob``; a pod disrupted by the cluster (preemption, eviction, a drained node) is
``Ignore``-d (replaced, not counted); any other failure is transient: torchrun restarts the node's
workers up to :data:`MAX_RESTARTS` times (every node's agent restarts when one node's workers do),
then the pod fails and counts against ``backoffLimit`` = :data:`BACKOFF_PER_NODE` × nodes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

from training.config import ConfigError, read_config_tree
from training.data.cluster_plan import Cluster, ClusterPlan, parse_bytes
from training.fatal import FATAL_EXIT
from training.memory_plan import PROCESS_BASELINE_ENV

SHM_MARGIN = 1.25
"""/dev/shm given beyond the plan's batches in flight (collation and pinning copies, allocator slack)."""
MAX_RESTARTS = 2
"""torchrun's restarts of a node's workers before the pod fails."""
BACKOFF_PER_NODE = 2
"""Failed pods the Job tolerates per node (transient failures only; disruptions are not counted)."""
NAME = "tonearm-train-mn"
SECRET = "tonearm-s3"
"""The Secret with the bucket's credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optional
AWS_ENDPOINT_URL and AWS_DEFAULT_REGION): created by the operator, never in git."""
FATAL_FILE = "/tmp/tonearm-fatal"
CONFIG_MAP = f"{NAME}-config"
"""The ConfigMap holding the run's config (key :data:`CONFIG_KEY`), rendered with the Job."""
CONFIG_KEY = "config.yaml"
CONFIG_PATH = f"/etc/tonearm/{CONFIG_KEY}"
"""Where the pod reads its config: the ConfigMap mounted read-only."""
BASELINE_KEY = "process-baseline.json"
BASELINE_PATH = f"/etc/tonearm/{BASELINE_KEY}"
"""Where the pod reads the process calibration (``--process-baseline``), ``$TONEARM_PROCESS_BASELINE``:
the ConfigMap's key :data:`BASELINE_KEY`, mounted beside the config."""
DAEMONSET_CPU = 1.0
"""Cores left for DaemonSets' requests (device plugin, log and metrics agents) by the default margin."""
DAEMONSET_MEMORY = 2 * 2**30
"""Memory left for DaemonSets' requests by the default margin."""

SCRIPT = """\
umask 022
set -f  # no globbing: an override such as data.languages=[eng,fra] is a word, never a pattern
run="/shared/runs/$RUN_ID"
rm -f "$TONEARM_FATAL_FILE"
eval "set -- $EXTRA"  # the other overrides: EXTRA holds them shell-quoted, one word each
status=0
torchrun --nnodes "$MIN_NODES:$NODES" --nproc-per-node "$GPUS" \\
  --rdzv-backend c10d --rdzv-endpoint {endpoint} \\
  --rdzv-id "$RUN_ID" --max-restarts {restarts} \\
  -m tonearm.cli train "$CONFIG" data.manifest=null data.shards="$SHARDS" \\
  data.num_workers="$WORKERS" out_dir="$run" resume=true save_every_steps="$SAVE_EVERY_STEPS" \\
  "$@" || status=$?
if [ "$status" != 0 ]; then
  if [ -f "$TONEARM_FATAL_FILE" ]; then
    echo "deterministic failure, not retried: $(cat "$TONEARM_FATAL_FILE")" >&2
    exit {fatal}
  fi
  exit "$status"
fi
if [ "$JOB_COMPLETION_INDEX" = 0 ]; then
  if [ -z "$CATALOGUE" ]; then
    echo "trained: $run/best. Not exported: tonearm export indexes a JSONL manifest of the catalogue's audio" \\
      "(--data), which a run from data.shards does not have; set CATALOGUE to one on the shared claim, or run" \\
      "tonearm export $run/best --data MANIFEST --out /bundles where the audio is (docs/deploy.md)" >&2
  elif [ ! -f "$CATALOGUE" ]; then
    echo "trained: $run/best. Not exported: CATALOGUE=$CATALOGUE is not a file in the pod" >&2
  else
    tonearm export "$run/best" --data "$CATALOGUE" --out /bundles
  fi
fi
"""


def default_allocatable(cores: int, memory: int) -> tuple[float, int]:
    """(cores, bytes) a pod may request on a node of ``cores`` and ``memory`` when the node's allocatable
    is not given: GKE's published reservation (kube-reserved CPU: 6 % of the first core, 1 % of the
    next, 0.5 % of the next 2, 0.25 % above 4; memory: 25 % of the first 4 GiB, 20 % of the next 4,
    10 % of the next 8, 6 % of the next 112, 2 % above 128 GiB, plus the 100 MiB eviction threshold;
    other providers' formulas are of the same order) and :data:`DAEMONSET_CPU` / :data:`DAEMONSET_MEMORY`
    for DaemonSets."""
    reserved_cpu = _tiered(cores, ((1, 0.06), (2, 0.01), (4, 0.005), (math.inf, 0.0025)), 1)
    reserved = 100 * 2**20 + _tiered(memory, ((4, 0.25), (8, 0.20), (16, 0.10), (128, 0.06), (math.inf, 0.02)), 2**30)
    return cores - reserved_cpu - DAEMONSET_CPU, int(memory - reserved - DAEMONSET_MEMORY)


def _tiered(amount: float, tiers: tuple[tuple[float, float], ...], unit: float) -> float:
    """Σ share × the part of ``amount`` in each tier (``(upper bound in units, share)``, ascending)."""
    reserved, floor = 0.0, 0.0
    for upto, share in tiers:
        reserved += max(0.0, min(amount, upto * unit) - floor) * share
        floor = upto * unit
    return reserved


def parse_allocatable(text: str) -> tuple[float, int]:
    """``cpu=95690m,memory=470Gi`` (or the JSON of ``kubectl get node N -o jsonpath='{.status.allocatable}'``)
    → (cores, bytes)."""
    try:
        fields = json.loads(text) if text.lstrip().startswith("{") else dict(
            part.split("=", 1) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        fields = {}
    if not isinstance(fields, dict) or not {"cpu", "memory"} <= set(fields):
        raise ConfigError(f"--allocatable-per-node {text!r}: give cpu= and memory=, e.g. cpu=95690m,memory=470Gi "
                          "(kubectl describe node: Allocatable, less the DaemonSets' requests)")
    cpu = str(fields["cpu"])
    match = re.fullmatch(r"([0-9.]+)(m?)", cpu)
    if match is None:
        raise ConfigError(f"--allocatable-per-node: cpu={cpu!r} is not a CPU quantity (e.g. 95690m or 95.5)")
    return float(match[1]) / (1000 if match[2] else 1), parse_bytes(str(fields["memory"]))


def pod_cluster(cluster: Cluster, allocatable: str | None) -> tuple[Cluster, str]:
    """(the cluster as one pod per node sees it: its whole cores and memory out of the node's allocatable,
    the line that says so). ``allocatable``: ``--allocatable-per-node``, else :func:`default_allocatable`."""
    if allocatable:
        cores, memory = parse_allocatable(allocatable)
        source = f"--allocatable-per-node {allocatable}"
    else:
        cores, memory = default_allocatable(cluster.cores_per_node, cluster.memory_per_node)
        source = (f"the default margin: GKE's reservation formula and {DAEMONSET_CPU:g} core + "
                  f"{DAEMONSET_MEMORY / 2**30:g} GiB for DaemonSets; give --allocatable-per-node for this cluster")
    whole = int(math.floor(cores + 1e-9))
    memory = memory // 2**20 * 2**20  # whole MiB: the request's unit
    if whole < 1 or memory <= 0 or whole > cluster.cores_per_node or memory > cluster.memory_per_node:
        raise ConfigError(f"a pod cannot have {cores:g} cores and {memory / 2**30:.1f} GiB on a node of "
                          f"{cluster.cores_per_node} cores and {cluster.memory_per_node / 2**30:.1f} GiB ({source})")
    line = (f"pod per node: {whole} cores, {memory / 2**30:.1f} GiB of the node's {cluster.cores_per_node} cores, "
            f"{cluster.memory_per_node / 2**30:.1f} GiB ({source}); the plan below is the pod's")
    return dataclasses.replace(cluster, cores_per_node=whole, memory_per_node=memory), line


def gib(value: float) -> str:
    return f"{max(1, math.ceil(value / 2**30))}Gi"


def resources(plan: ClusterPlan, cluster: Cluster) -> dict[str, Any]:
    """The pod's CPU, memory, GPUs and /dev/shm from the plan of ``cluster`` — the pod's share of each
    node (:func:`pod_cluster`; module doc)."""
    memory = cluster.memory_per_node // 2**20
    return {"cpu": str(cluster.cores_per_node), "memory": f"{memory // 1024}Gi" if memory % 1024 == 0 else f"{memory}Mi",
            "gpus": str(cluster.gpus_per_node),
            "shm": gib(plan.shm_bytes * SHM_MARGIN), "workers": plan.layout.workers}


def job_manifest(plan: ClusterPlan, cluster: Cluster, *, config: str, shards: str, command: str,
                 extra: list[str] | None = None, min_nodes: int | None = None, run_id: str = "tonearm-mn-1",
                 save_every_steps: int = 500, catalogue: str = "",
                 process_baseline: str | None = None) -> dict[str, Any]:
    """The Job (a plain dict, as YAML gives it) of ``plan`` on ``cluster``, the pod's share of each node
    (module doc). ``config``: where the pod reads the config (:data:`CONFIG_PATH`, the ConfigMap of
    :func:`config_map`); ``extra``: the other overrides, each passed as one word; ``process_baseline``:
    where the pod reads a process calibration (:data:`BASELINE_PATH`), set as
    ``$TONEARM_PROCESS_BASELINE`` (None: not set)."""
    sized = resources(plan, cluster)
    labels = {"app.kubernetes.io/name": "tonearm", "app.kubernetes.io/component": "train-multinode"}
    nodes = cluster.nodes
    env: list[dict[str, Any]] = [
        {"name": "CONFIG", "value": config},
        {"name": "SHARDS", "value": shards},
        {"name": "EXTRA", "value": shlex.join(extra or [])},  # split by the script's eval: one word each
        {"name": "CATALOGUE", "value": catalogue},
        {"name": "RUN_ID", "value": run_id},
        {"name": "NODES", "value": str(nodes)},
        {"name": "MIN_NODES", "value": str(min_nodes or max(1, nodes // 2))},
        {"name": "GPUS", "value": sized["gpus"]},
        {"name": "WORKERS", "value": str(sized["workers"])},
        {"name": "SAVE_EVERY_STEPS", "value": str(save_every_steps)},
        {"name": "TONEARM_FATAL_FILE", "value": FATAL_FILE},
        *([{"name": PROCESS_BASELINE_ENV, "value": process_baseline}] if process_baseline else []),
        *({"name": key, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key, "optional": optional}}}
          for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                                ("AWS_ENDPOINT_URL", True), ("AWS_DEFAULT_REGION", True))),
    ]
    script = SCRIPT.format(endpoint=f"{NAME}-0.{NAME}:29400", restarts=MAX_RESTARTS, fatal=FATAL_EXIT)
    container = {
        "name": "train", "image": "tonearm:train", "imagePullPolicy": "IfNotPresent", "env": env,
        "command": ["/bin/bash", "-ceu"], "args": [script],
        "ports": [{"name": "rendezvous", "containerPort": 29400}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
        "resources": {"requests": {"cpu": sized["cpu"], "memory": sized["memory"], "nvidia.com/gpu": sized["gpus"]},
                      "limits": {"cpu": sized["cpu"], "memory": sized["memory"], "nvidia.com/gpu": sized["gpus"]}},
        "volumeMounts": [{"name": "shared", "mountPath": "/shared"}, {"name": "bundles", "mountPath": "/bundles"},
                         {"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "config", "mountPath": str(Path(CONFIG_PATH).parent), "readOnly": True}],
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": NAME, "labels": labels, "annotations": {"tonearm.dev/plan": command}},
        "spec": {
            "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
            "backoffLimit": BACKOFF_PER_NODE * nodes,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In",
                                                      "values": [FATAL_EXIT]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "subdomain": NAME, "restartPolicy": "Never", "automountServiceAccountToken": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                        "fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch",
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [
                        {"name": "shared", "persistentVolumeClaim": {"claimName": "tonearm-train-shared"}},
                        {"name": "bundles", "persistentVolumeClaim": {"claimName": "tonearm-bundles"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": sized["shm"]}},
                        {"name": "config", "configMap": {"name": CONFIG_MAP}},
                    ],
                },
            },
        },
    }


def config_map(text: str, *, source: str, baseline: tuple[str, str] | None = None) -> dict[str, Any]:
    """The ConfigMap of the run's config (``text``: one self-contained YAML file; ``source``: where it was
    read, recorded in an annotation) and, when given, of a process calibration (``baseline``: (the
    file's text, where it was read), under :data:`BASELINE_KEY`)."""
    labels = {"app.kubernetes.io/name": "tonearm", "app.kubernetes.io/component": "train-multinode"}
    annotations = {"tonearm.dev/config-source": source}
    data = {CONFIG_KEY: text}
    if baseline is not None:
        data[BASELINE_KEY], annotations["tonearm.dev/process-baseline-source"] = baseline
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "labels": labels, "annotations": annotations},
            "data": data}


def config_text(path: str | None) -> str:
    """The config as the pod reads it: the file at ``path`` with its ``extends`` chain resolved (the
    ConfigMap holds one file), or an empty mapping (the defaults) when no config was given."""
    import yaml

    tree = read_config_tree(Path(path)) if path else {}
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True, width=120) if tree else "{}\n"


HEADER = """\
# Multi-node training from the bucket: an Indexed Job of NODES pods, each running torchrun with
# the c10d rendezvous hosted by pod 0 (reached through the headless Service), the shards read
# from data.shards (s3://…, credentials from the Secret tonearm-s3), checkpoints on a
# ReadWriteMany claim every node mounts, the config in the ConfigMap beside the Job. Rendered by
# the command in the tonearm.dev/plan annotation (`tonearm train CONFIG --plan … --emit-k8s`): CPU,
# memory and /dev/shm are the plan's for the pod's share of each node (allocatable, not capacity),
# and the failure policy ends the Job on a deterministic failure (exit 42). docs/deploy.md,
# "Training Job: from the plan"; docs/training.md, "Kubernetes multi-node".
"""


def job_yaml(job: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """The ConfigMap (when given) and the Job as the YAML of k8s/train-multinode/job.yaml (the script
    and the config as literal blocks)."""
    import copy

    import yaml

    class Block(str):
        pass

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(Block, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                                                                 style="|"))
    job = copy.deepcopy(job)
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [Block(arg) for arg in container["args"]]
    documents = [job]
    if config is not None:
        config = copy.deepcopy(config)
        config["data"] = {key: Block(value) for key, value in config["data"].items()}
        documents.insert(0, config)
    return HEADER + yaml.dump_all(documents, Dumper=Dumper, sort_keys=False, width=120)


JOB_SETTINGS = ("data.shards=", "data.manifest=", "out_dir=", "data.num_workers=", "resume=", "save_every_steps=")
"""Overrides the Job's script sets itself (left out of ``EXTRA``)."""


def emit(args: Any, cfg: Any, plan: ClusterPlan, cluster: Cluster) -> str:
    """The YAML ``--emit-k8s`` prints for a plan that fits: the config's ConfigMap and the Job, of
    ``cluster`` as a pod sees it (:func:`pod_cluster`); with ``--process-baseline FILE``, the file in the
    ConfigMap and ``$TONEARM_PROCESS_BASELINE`` naming it in the pod (module doc)."""
    extra = [o for o in getattr(args, "overrides", []) if not o.startswith(JOB_SETTINGS)]
    command = "tonearm " + " ".join(shlex.quote(a) for a in getattr(args, "argv", []) or [])
    calibration = getattr(args, "process_baseline", None)
    baseline = (_read_text(calibration, "--process-baseline"), calibration) if calibration else None
    job = job_manifest(plan, cluster, config=CONFIG_PATH, shards=str(cfg.data.shards), command=command, extra=extra,
                       process_baseline=BASELINE_PATH if baseline else None)
    return job_yaml(job, config_map(config_text(args.config), source=args.config or "defaults", baseline=baseline))


def _read_text(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{option} {path}: cannot be read ({err})") from None
