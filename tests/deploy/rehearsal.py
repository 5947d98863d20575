"""A rehearsal of the rendered k8s/base manifests with real containers (podman, rootful).

What a cluster would run, translated object by object from the *rendered* YAML (nothing
hand-copied): the ``tonearm`` Deployment as two replicas and the ``tonearm-redis`` Deployment, each
container with the manifest's command and args, its ConfigMap (``envFrom``) and ``env`` (literal
values and ``secretKeyRef``s, resolved from the Secret this rehearsal creates — a required key
that is missing stops it, as a kubelet would), ``runAsUser``/``runAsGroup``/``fsGroup``, the
read-only root file system, dropped capabilities and no privilege escalation, the CPU and memory
limits, and every volume mount: each PersistentVolumeClaim is one podman volume shared by every
container that mounts it (read-only where the manifest says so), with the claim's root group-owned
by ``fsGroup`` as a kubelet does; an ``emptyDir`` is a tmpfs of its ``sizeLimit``. The liveness
probe is the container's healthcheck; the startup and readiness probes' HTTP paths are polled for
``periodSeconds × failureThreshold`` (the startup budget). Services become network aliases.

Replaced, because they are deploy-time values: the image (the locally built
``localhost/tonearm:service-test``, scripts/container-image.sh), the placeholder ``TONEARM_BUNDLE``
(the rehearsed bundle's id) and Redis's image (a local one; same args).

Scenario (:func:`rehearse`): both replicas ready; an item added on one is found by search on the
other; a takedown on one hides the clip on both; a replica killed (SIGKILL) while a writer streams
items to it comes back (``podman start``, as the kubelet restarts a container) with every item
that was acknowledged (201) before the kill, on both replicas.

    sudo python -m tests.deploy.rehearsal BUNDLE_DIR     (from the repository root)
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.deploy.kustomize_lite import render, render_with_kubectl

ROOT = Path(__file__).resolve().parents[2]
SERVICE_IMAGE = "localhost/tonearm:service-test"
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
REPLICAS = 2


class RehearsalError(AssertionError):
    """The rehearsal found the deployment broken (the message says where)."""


def log(message: str) -> None:
    print(f"[rehearsal] {message}", flush=True)


def rendered_base() -> list[dict[str, Any]]:
    directory = ROOT / "k8s" / "base"
    return render_with_kubectl(directory) or render(directory)


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(found) != 1:
        raise RehearsalError(f"the rendered manifests hold {len(found)} {kind}/{name}")
    return found[0]


def _memory(value: str) -> str:
    units = {"Ki": "k", "Mi": "m", "Gi": "g"}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()  # type: ignore[union-attr]
    return f"{number}{units.get(unit, 'b' if not unit else unit)}"


def _cpus(value: str) -> str:
    text = str(value)
    return str(int(text[:-1]) / 1000) if text.endswith("m") else text


class Podman:
    def __init__(self, conf: Path) -> None:
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run(["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout,
                              check=False)
        if check and done.returncode != 0:
            raise RehearsalError(f"podman {' '.join(args[:3])} … failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return done.stdout.strip()


class Deployment:
    """The podman runs of one rendered Deployment's pod template."""

    def __init__(self, podman: Podman, objects: list[dict[str, Any]], name: str, *, run_id: str, image: str,
                 secrets_: dict[tuple[str, str], str], overrides: dict[str, str], volumes: dict[str, str]) -> None:
        self.podman, self.objects, self.run_id = podman, objects, run_id
        self.deployment = _one(objects, "Deployment", name)
        self.pod = self.deployment["spec"]["template"]["spec"]
        (self.container,) = self.pod["containers"]
        self.image, self.secrets, self.overrides, self.volumes = image, secrets_, overrides, volumes
        self.extra_args: list[str] = []
        """Appended to the container's args (the local Redis image lacks the official image's entrypoint,
        which adds ``--protected-mode no`` when Redis runs without a config file)."""

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            ref = source["configMapRef"]["name"]
            values.update({k: str(v) for k, v in _one(self.objects, "ConfigMap", ref)["data"].items()})
        for entry in self.container.get("env", []):
            if "value" in entry:
                values[entry["name"]] = str(entry["value"])
                continue
            ref = entry["valueFrom"]["secretKeyRef"]
            key = (ref["name"], ref["key"])
            if key in self.secrets:
                values[entry["name"]] = self.secrets[key]
            elif not ref.get("optional"):
                raise RehearsalError(f"{entry['name']}: Secret {ref['name']} has no key {ref['key']} (the pod would not start)")
        values.update({k: v for k, v in self.overrides.items() if k in values})
        return values

    def run_args(self, name: str, *, aliases: list[str], publish: int | None) -> list[str]:
        pod_ctx, ctx = self.pod.get("securityContext", {}), self.container.get("securityContext", {})
        user = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
        group = ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
        args = ["run", "-d", "--name", name, "--network", self.run_id]
        for alias in aliases:
            args += ["--network-alias", alias]
        if user is not None:
            args += ["--user", f"{user}:{group if group is not None else user}"]
        if pod_ctx.get("fsGroup") is not None:
            args += ["--group-add", str(pod_ctx["fsGroup"])]
        if ctx.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        if ctx.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        for cap in ctx.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        limits = self.container.get("resources", {}).get("limits", {})
        if "memory" in limits:
            args += ["--memory", _memory(limits["memory"])]
        if "cpu" in limits:
            args += ["--cpus", _cpus(limits["cpu"])]
        if "terminationGracePeriodSeconds" in self.pod:
            args += ["--stop-timeout", str(self.pod["terminationGracePeriodSeconds"])]
        volumes = {v["name"]: v for v in self.pod.get("volumes", [])}
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]
                read_only = mount.get("readOnly") or claim.get("readOnly")
                args += ["-v", f"{self.volumes[claim['claimName']]}:{mount['mountPath']}{':ro' if read_only else ''}"]
            elif "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit", "64Mi")
                args += ["--tmpfs", f"{mount['mountPath']}:rw,size={_memory(size)},mode=1777"]
            else:
                raise RehearsalError(f"volume {mount['name']}: only claims and emptyDirs are rehearsed")
        liveness = self.container.get("livenessProbe")
        if liveness and "httpGet" in liveness:
            path, port = liveness["httpGet"]["path"], self._port(liveness["httpGet"]["port"])
            args += ["--health-cmd", f"python -c \"import urllib.request; urllib.request.urlopen("
                                     f"'http://127.0.0.1:{port}{path}', timeout={liveness.get('timeoutSeconds', 1)})\"",
                     "--health-interval", f"{liveness.get('periodSeconds', 10)}s",
                     "--health-retries", str(liveness.get("failureThreshold", 3)),
                     "--health-timeout", f"{liveness.get('timeoutSeconds', 1)}s"]
        else:  # a tcpSocket/exec liveness probe (Redis): polled by the rehearsal where it matters
            args += ["--health-interval", "disable"]
        if publish is not None:
            args += ["-p", f"127.0.0.1:{publish}:{self._port('http')}"]
        for key, value in sorted(self.env().items()):
            args += ["-e", f"{key}={value}"]
        if "command" in self.container:
            args += ["--entrypoint", self.container["command"][0]]
        args.append(self.image)
        args += [*self.container.get("command", [])[1:], *self.container.get("args", []), *self.extra_args]
        return args

    def _port(self, port: Any) -> int:
        if isinstance(port, int):
            return port
        return next(int(p["containerPort"]) for p in self.container.get("ports", []) if p.get("name") == port)

    def startup_budget_s(self) -> float:
        probe = self.container.get("startupProbe") or self.container.get("readinessProbe") or {}
        return float(probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))

    def ready_path(self) -> str:
        return str((self.container.get("readinessProbe") or {}).get("httpGet", {}).get("path", "/readyz"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tone_wav(freq: float, seconds: float = 1.0, rate: int = 16_000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * i / rate)))
                               for i in range(int(seconds * rate))))
    return buffer.getvalue()


def _wait(predicate, timeout: float, what: str, interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(interval)
    raise RehearsalError(f"timed out after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def cluster(bundle: Path, *, image: str, redis_image: str, work: Path) -> Iterator[dict[str, Any]]:
    """Start Redis and two service replicas from the rendered manifests; yield their URLs and names."""
    objects = rendered_base()
    run_id = f"tonearm-rehearsal-{os.getpid()}"
    conf = work / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    podman = Podman(conf)
    token = secrets.token_hex(24)
    claims = [o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"]
    volumes = {claim: f"{run_id}-{claim}" for claim in claims}
    started: list[str] = []
    try:
        podman("network", "create", run_id)
        service = Deployment(podman, objects, "tonearm", run_id=run_id, image=image,
                             secrets_={("tonearm-admin", "token"): token},
                             overrides={"TONEARM_BUNDLE": bundle.name}, volumes=volumes)
        fs_group = service.pod.get("securityContext", {}).get("fsGroup")
        for claim, volume in volumes.items():
            podman("volume", "create", volume)
            path = Path(podman("volume", "mount", volume))
            if claim == "tonearm-bundles":
                shutil.copytree(bundle, path / bundle.name)
                subprocess.run(["chmod", "-R", "a+rX", str(path)], check=True)
            if fs_group is not None:  # what a kubelet does with fsGroup: the claim's root, group-owned and setgid
                os.chown(path, 0, int(fs_group))
                path.chmod(0o2775)
        redis = Deployment(podman, objects, "tonearm-redis", run_id=run_id, image=redis_image, secrets_={},
                           overrides={}, volumes=volumes)
        redis.extra_args = ["--protected-mode", "no"]
        redis_service = _one(objects, "Service", "tonearm-redis")["metadata"]["name"]
        podman(*redis.run_args(f"{run_id}-redis", aliases=[redis_service], publish=None))
        started.append(f"{run_id}-redis")
        _wait(lambda: podman("exec", f"{run_id}-redis", "redis-cli", "ping", check=False) == "PONG", 30, "redis")
        replicas = []
        for i in range(REPLICAS):
            name, port = f"{run_id}-tonearm-{i}", _free_port()
            podman(*service.run_args(name, aliases=[], publish=port))
            started.append(name)
            replicas.append({"name": name, "url": f"http://127.0.0.1:{port}"})
        for replica in replicas:
            wait_ready(podman, replica, service)
            if service.container.get("livenessProbe"):  # podman schedules healthchecks with systemd timers (absent
                podman("healthcheck", "run", replica["name"])  # in CI containers): run the liveness command once
        yield {"podman": podman, "replicas": replicas, "token": token, "service": service, "run_id": run_id}
    finally:
        for name in reversed(started):
            if os.environ.get("REHEARSAL_LOGS"):
                print(podman("logs", name, check=False), file=sys.stderr)
            podman("rm", "-f", "-t", "2", name, check=False)
        for volume in volumes.values():
            podman("volume", "unmount", volume, check=False)
            podman("volume", "rm", "-f", volume, check=False)
        podman("network", "rm", "-f", run_id, check=False)


def wait_ready(podman: Podman, replica: dict[str, str], service: Deployment) -> None:
    url = replica["url"] + service.ready_path()
    try:
        _wait(lambda: httpx.get(url, timeout=3).status_code == 200, service.startup_budget_s(),
              f"{replica['name']} {service.ready_path()}")
    except RehearsalError:
        body = ""
        with contextlib.suppress(httpx.HTTPError):
            body = httpx.get(url, timeout=3).text
        raise RehearsalError(f"{replica['name']} not ready: {body}\n{podman('logs', replica['name'], check=False)[-3000:]}") from None


def rehearse(bundle: Path, *, image: str, redis_image: str) -> dict[str, Any]:
    """The scenario of the module docstring; returns what it measured."""
    started = time.monotonic()
    numbers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tonearm-rehearsal-", dir="/var/tmp") as tmp, \
            cluster(bundle, image=image, redis_image=redis_image, work=Path(tmp)) as c:
        numbers["ready_s"] = round(time.monotonic() - started, 1)
        log(f"2 replicas and redis ready in {numbers['ready_s']} s")
        podman, service = c["podman"], c["service"]
        a, b = (httpx.Client(base_url=r["url"], timeout=30) for r in c["replicas"])
        admin = {"Authorization": f"Bearer {c['token']}"}

        # 1. an item added on A is found by search on B
        r = a.post("/v1/items", headers=admin, data={"id": "rehearsal-a", "metadata": '{"origin": "rehearsal"}'},
                   files={"file": ("a.wav", tone_wav(440.0), "audio/wav")})
        if r.status_code != 201:
            raise RehearsalError(f"POST /v1/items on replica 0: {r.status_code} {r.text}")

        def found_on_b() -> bool:
            hits = b.post("/v1/search/text", json={"query": "a sound", "k": 5, "filter": {"origin": "rehearsal"}})
            return hits.status_code == 200 and [h["id"] for h in hits.json()["hits"]] == ["rehearsal-a"]

        t0 = time.monotonic()
        _wait(found_on_b, 10, "the item added on replica 0 to be found on replica 1", interval=0.05)
        numbers["item_visible_on_other_s"] = round(time.monotonic() - t0, 2)
        log(f"item added on replica 0 found by search on replica 1 after {numbers['item_visible_on_other_s']} s")

        # 2. a takedown on B hides the clip on both
        query = {"query": "a dog barks", "k": 3}
        clip = a.post("/v1/search/text", json=query).json()["hits"][0]["id"]
        if b.delete(f"/v1/items/{clip}", headers=admin).status_code != 200:
            raise RehearsalError(f"DELETE of bundle clip {clip} on replica 1 failed")
        for client, name in ((b, "replica 1"), (a, "replica 0")):
            _wait(lambda client=client: clip not in {h["id"] for h in client.post("/v1/search/text", json=query)
                                                     .json()["hits"]}, 10, f"the takedown of {clip} on {name}",
                  interval=0.05)
        log(f"takedown of {clip} on replica 1 hides it on both replicas")

        # 3. replica 0 killed while a writer streams items to it
        acknowledged: list[str] = []
        stop = threading.Event()

        def writer() -> None:
            with httpx.Client(base_url=c["replicas"][0]["url"], timeout=10) as w:
                for i in range(10_000):
                    if stop.is_set():
                        return
                    try:
                        resp = w.post("/v1/items", headers=admin, data={"id": f"w-{i:05d}"},
                                      files={"file": ("w.wav", tone_wav(300.0 + i, 0.5), "audio/wav")})
                    except httpx.HTTPError:
                        return
                    if resp.status_code == 201:
                        acknowledged.append(f"w-{i:05d}")

        thread = threading.Thread(target=writer)
        thread.start()
        _wait(lambda: len(acknowledged) >= 5, 60, "5 acknowledged writes")
        podman("kill", "--signal", "KILL", c["replicas"][0]["name"])
        stop.set()
        thread.join(30)
        numbers["acknowledged_before_kill"] = len(acknowledged)
        log(f"replica 0 killed (SIGKILL) mid-stream after {len(acknowledged)} acknowledged writes")
        t0 = time.monotonic()
        podman("start", c["replicas"][0]["name"])
        wait_ready(podman, c["replicas"][0], service)
        numbers["restart_ready_s"] = round(time.monotonic() - t0, 1)
        for client, name in ((a, "replica 0 (restarted)"), (b, "replica 1")):
            missing = [i for i in acknowledged if client.get(f"/v1/items/{i}", headers=admin).status_code != 200]
            if missing:
                raise RehearsalError(f"{name} lost acknowledged items: {missing[:10]} ({len(missing)} in all)")
        if clip in {h["id"] for h in a.post("/v1/search/text", json=query).json()["hits"]}:
            raise RehearsalError(f"the restarted replica serves the taken-down clip {clip}")
        log(f"replica 0 back in {numbers['restart_ready_s']} s with all {len(acknowledged)} acknowledged items "
            "(and the takedown); replica 1 has them too")
        a.close()
        b.close()
    numbers["total_s"] = round(time.monotonic() - started, 1)
    log(f"PASS in {numbers['total_s']} s")
    return numbers


def build_images() -> tuple[str, str]:
    """The images of scripts/container-image.sh (built or taken from podman's cache)."""
    done = subprocess.run([str(ROOT / "scripts" / "container-image.sh")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}, check=False)
    if done.returncode != 0:
        raise RehearsalError(f"scripts/container-image.sh failed:\n{done.stderr[-4000:]}")
    image, redis_image = done.stdout.split()[-2:]
    return image, redis_image


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: sudo python -m tests.deploy.rehearsal BUNDLE_DIR")
    print(rehearse(Path(sys.argv[1]).resolve(), **dict(zip(("image", "redis_image"), build_images(), strict=True))))
