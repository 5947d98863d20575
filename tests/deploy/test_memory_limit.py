"""The shipped service manifests size the pod's memory limit by the formula of docs/service.md ("Memory: the
pod's limit", :func:`service.memory_budget.pod_memory_bytes`) from their own ConfigMap (issue 55, part 1):
160 concurrent legitimate uploads took a replica to 2,206 MiB, over the base Deployment's 2 GiB, when
nothing bounded the request bodies. The upload budget now does; this checks that each limit leaves room
for it, for the bundles the Deployment says it serves (its ``tonearm/serving-memory`` annotation) and
for ``/tmp`` (a memory volume), and that the check fails when a ConfigMap raises the budget past it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.deploy.test_manifests import SERVICE, by_kind, quantity, rendered

SERVING_ANNOTATION = "tonearm/serving-memory"


def memory_problems(objects: list[dict[str, Any]]) -> list[str]:
    from service.memory_budget import pod_memory_bytes
    from service.settings import Settings

    deployment = by_kind(objects, "Deployment", "tonearm")
    config = by_kind(objects, "ConfigMap", "tonearm-config")["data"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    serving = (deployment["metadata"].get("annotations") or {}).get(SERVING_ANNOTATION)
    if serving is None:
        return [f"the Deployment has no {SERVING_ANNOTATION} annotation: what its memory limit is sized for"]
    values = {k[len("TONEARM_"):].lower(): v for k, v in config.items() if v is not None}
    settings = Settings.model_validate({**values, "admin_token": "x" * 32})
    tmp = sum(quantity(v["emptyDir"].get("sizeLimit", "0")) for v in pod["volumes"]
              if (v.get("emptyDir") or {}).get("medium") == "Memory")
    needed = pod_memory_bytes(settings, serving=int(quantity(serving)), tmp=int(tmp))
    limit = quantity(container["resources"]["limits"]["memory"])
    if limit < needed:
        return [f"limits.memory {limit / 2**20:.0f} MiB < {needed / 2**20:.0f} MiB: serving {serving} + uploads "
                f"(TONEARM_DECODE_MEMORY_BYTES {settings.decode_memory_bytes}) + /tmp {tmp / 2**20:.0f} MiB, x 1.1"]
    return []


@pytest.mark.parametrize("name", SERVICE)
def test_the_memory_limit_leaves_room_for_the_upload_budget(name):
    objects = rendered(name)
    assert memory_problems(objects) == []
    config = by_kind(objects, "ConfigMap", "tonearm-config")["data"]
    assert config["TONEARM_DECODE_MEMORY_BYTES"] == "134217728"  # the default, spelled out beside the limit


@pytest.mark.parametrize(("what", "change"), [
    ("a budget raised to 2 GiB", lambda o: by_kind(o, "ConfigMap", "tonearm-config")["data"]
     .update(TONEARM_DECODE_MEMORY_BYTES=str(2 << 30))),
    ("a limit lowered to 1 GiB", lambda o: by_kind(o, "Deployment", "tonearm")["spec"]["template"]["spec"]
     ["containers"][0]["resources"]["limits"].update(memory="1Gi")),
    ("a much larger bundle", lambda o: by_kind(o, "Deployment", "tonearm")["metadata"]["annotations"]
     .update({SERVING_ANNOTATION: "1900Mi"})),
    ("no annotation", lambda o: by_kind(o, "Deployment", "tonearm")["metadata"].pop("annotations")),
])
def test_the_memory_check_fails_on_a_limit_that_does_not_follow_the_formula(what, change):
    objects = copy.deepcopy(rendered("base"))
    change(objects)
    assert memory_problems(objects), what
