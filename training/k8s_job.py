"""`tonearm train CONFIG --plan … --emit-k8s`: the multi-node Kubernetes Job of k8s/train-multinode,
sized by the plan of the cluster given (docs/deploy.md, "Training Job: from the plan").

A renderer above the plan it renders (:mod:`training.data.cluster_plan` never imports it): the
dry run that prints both is :func:`training.launch.cli_plan`.

The plan (:func:`training.data.cluster_plan.plan_for`) → the Job, per pod (one pod = one node):

* ``cpu`` requests = limits = ``--cores-per-node`` (a CPU limit sets the cgroup quota, so
  ``data.num_workers: auto`` inside the pod sees these cores, not the whole machine's), and
  ``data.num_workers`` is passed explicitly as the plan's workers per rank;
* ``memory`` requests = limits = ``--memory-per-node``: what the plan sized the shuffle buffers from
  (``data.shuffle_buffer: auto`` takes a share of the memory the pod is given, its cgroup limit)
  and checked everything it counts against (loader, processes, caches, knowledge-base copies: at most
  :data:`~training.data.cluster_plan.HOST_HEADROOM` of it) — the /dev/shm volume's pages are charged
  to it too, and the plan's host figure already holds the batches in flight;
* the ``shm`` volume's ``sizeLimit`` = the plan's /dev/shm per node × :data:`SHM_MARGIN`, rounded
  up to a GiB; a run checks /dev/shm against its own layout at start and refuses one too small;
* ``nvidia.com/gpu`` = ``--gpus-per-node``; ``completions`` = ``parallelism`` = ``--nodes``.

Failure policy (training/fatal.py): a deterministic failure (``DataError``, ``ConfigError``, a
refused plan) makes the pod exit :data:`training.fatal.FATAL_EXIT`, which ``podFailurePolicy``
marks ``FailJob``; a pod disrupted by the cluster (preemption, eviction, a drained node) is
``Ignore``-d (replaced, not counted); any other failure is transient: torchrun restarts the node's
workers up to :data:`MAX_RESTARTS` times (every node's agent restarts when one node's workers do),
then the pod fails and counts against ``backoffLimit`` = :data:`BACKOFF_PER_NODE` × nodes.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from training.data.cluster_plan import Cluster, ClusterPlan
from training.fatal import FATAL_EXIT

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

SCRIPT = """\
umask 022
run="/shared/runs/$RUN_ID"
rm -f "$TONEARM_FATAL_FILE"
status=0
torchrun --nnodes "$MIN_NODES:$NODES" --nproc-per-node "$GPUS" \\
  --rdzv-backend c10d --rdzv-endpoint {endpoint} \\
  --rdzv-id "$RUN_ID" --max-restarts {restarts} \\
  -m tonearm.cli train "$CONFIG" data.manifest=null data.shards="$SHARDS" \\
  data.num_workers="$WORKERS" out_dir="$run" resume=true save_every_steps="$SAVE_EVERY_STEPS" \\
  $EXTRA || status=$?
if [ "$status" != 0 ]; then
  if [ -f "$TONEARM_FATAL_FILE" ]; then
    echo "deterministic failure, not retried: $(cat "$TONEARM_FATAL_FILE")" >&2
    exit {fatal}
  fi
  exit "$status"
fi
if [ "$JOB_COMPLETION_INDEX" = 0 ]; then
  tonearm export "$run/best" --data "$CATALOGUE" --out /bundles
fi
"""


def gib(value: float) -> str:
    return f"{max(1, math.ceil(value / 2**30))}Gi"


def resources(plan: ClusterPlan, cluster: Cluster) -> dict[str, Any]:
    """The pod's CPU, memory, GPUs and /dev/shm from the plan (module doc)."""
    return {"cpu": str(cluster.cores_per_node), "memory": gib(cluster.memory_per_node), "gpus": str(cluster.gpus_per_node),
            "shm": gib(plan.shm_bytes * SHM_MARGIN), "workers": plan.layout.workers}


def job_manifest(plan: ClusterPlan, cluster: Cluster, *, config: str, shards: str, command: str,
                 extra: list[str] | None = None, min_nodes: int | None = None, run_id: str = "tonearm-mn-1",
                 save_every_steps: int = 500, catalogue: str = "/shared/corpus/manifest.jsonl") -> dict[str, Any]:
    """The Job (a plain dict, as YAML gives it) of ``plan`` on ``cluster`` (module doc)."""
    sized = resources(plan, cluster)
    labels = {"app.kubernetes.io/name": "tonearm", "app.kubernetes.io/component": "train-multinode"}
    nodes = cluster.nodes
    env: list[dict[str, Any]] = [
        {"name": "CONFIG", "value": config},
        {"name": "SHARDS", "value": shards},
        {"name": "EXTRA", "value": " ".join(extra or [])},  # overrides: word-split by the script, no spaces inside
        {"name": "CATALOGUE", "value": catalogue},
        {"name": "RUN_ID", "value": run_id},
        {"name": "NODES", "value": str(nodes)},
        {"name": "MIN_NODES", "value": str(min_nodes or max(1, nodes // 2))},
        {"name": "GPUS", "value": sized["gpus"]},
        {"name": "WORKERS", "value": str(sized["workers"])},
        {"name": "SAVE_EVERY_STEPS", "value": str(save_every_steps)},
        {"name": "TONEARM_FATAL_FILE", "value": FATAL_FILE},
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
                         {"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}],
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
                    ],
                },
            },
        },
    }


HEADER = """\
# Multi-node training from the bucket: an Indexed Job of NODES pods, each running torchrun with
# the c10d rendezvous hosted by pod 0 (reached through the headless Service), the shards read
# from data.shards (s3://…, credentials from the Secret tonearm-s3), checkpoints on a
# ReadWriteMany claim every node mounts. Rendered by the command in the tonearm.dev/plan
# annotation (`tonearm train CONFIG --plan … --emit-k8s`): CPU, memory and /dev/shm are the
# plan's for that cluster shape, and the failure policy ends the Job on a deterministic failure
# (exit 42). docs/deploy.md, "Training Job: from the plan"; docs/training.md, "Kubernetes multi-node".
"""


def job_yaml(job: dict[str, Any]) -> str:
    """The Job as the YAML of k8s/train-multinode/job.yaml (the script as a literal block)."""
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
    return HEADER + yaml.dump(job, Dumper=Dumper, sort_keys=False, width=120)


JOB_SETTINGS = ("data.shards=", "data.manifest=", "out_dir=", "data.num_workers=", "resume=", "save_every_steps=")
"""Overrides the Job's script sets itself (left out of ``EXTRA``)."""


def emit(args: Any, cfg: Any, plan: ClusterPlan, cluster: Cluster) -> str:
    """The YAML ``--emit-k8s`` prints for a plan that fits."""
    extra = [o for o in getattr(args, "overrides", []) if not o.startswith(JOB_SETTINGS)]
    command = "tonearm " + " ".join(shlex.quote(a) for a in getattr(args, "argv", []) or [])
    job = job_manifest(plan, cluster, config=args.config or "configs/default.yaml", shards=str(cfg.data.shards),
                       command=command, extra=extra)
    return job_yaml(job)
