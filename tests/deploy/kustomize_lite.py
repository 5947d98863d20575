"""Render k8s/ kustomizations without kubectl: the subset of kustomize our manifests use.

Used by the manifest tests when neither ``kubectl`` nor ``kustomize`` is installed (a
newcomer's machine); where ``kubectl`` is present a test checks that this renderer and
``kubectl kustomize`` give the same objects. Supported: ``resources`` (files and
directories holding a kustomization), ``namespace``, ``images`` (newName/newTag) and
``patches`` given by ``path`` (strategic-merge patches: maps merge, lists of named maps
merge by ``name`` with new elements first, other lists are replaced; the deletions ``key: null`` in a map, ``$patch: delete``
on an element of a named list, and a patch document that is ``$patch: delete`` of a whole object). Anything else is refused by name, so a new
kustomize feature in k8s/ fails loudly here instead of rendering something different.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


class UnsupportedKustomization(ValueError):
    """A kustomization using a feature this renderer does not implement."""


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` would print, for the supported subset."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED_KEYS
    if unsupported:
        raise UnsupportedKustomization(
            f"{directory / 'kustomization.yaml'}: {', '.join(sorted(unsupported))} not supported by "
            "tests/deploy/kustomize_lite.py; install kubectl or extend the renderer"
        )
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise UnsupportedKustomization(f"{directory}: only `patches: - path: FILE` is supported, not {patch_entry}")
        patch = yaml.safe_load((directory / patch_entry["path"]).read_text())
        target = _find(objects, patch["kind"], patch["metadata"]["name"], directory)
        if patch.get("$patch") == "delete":
            objects.remove(target)
            continue
        objects[objects.index(target)] = merge(target, patch)
    for image in kustomization.get("images", []):
        for obj in objects:
            _retag(obj, image)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
    return objects


def merge(base: Any, patch: Any) -> Any:
    """Strategic-merge subset: maps merge key by key; lists of named maps merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
                continue
            merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        merged_list = copy.deepcopy(base)
        added = []  # kubectl puts a patch's new elements first, in the patch's order
        for item in patch:
            existing = next((i for i, old in enumerate(merged_list) if old["name"] == item["name"]), None)
            if item.get("$patch") == "delete":
                if existing is not None:
                    del merged_list[existing]
                continue
            if existing is None:
                added.append(copy.deepcopy(item))
            else:
                merged_list[existing] = merge(merged_list[existing], item)
        return added + merged_list
    return copy.deepcopy(patch)


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


def _find(objects: list[dict[str, Any]], kind: str, name: str, directory: Path) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise UnsupportedKustomization(f"{directory}: patch targets {kind}/{name}, which no resource defines")


def _retag(obj: dict[str, Any], image: dict[str, str]) -> None:
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else {}
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def render_with_kubectl(directory: Path) -> list[dict[str, Any]] | None:
    """``kubectl kustomize`` (or ``kustomize build``) output, or None when neither is installed."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(directory)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(directory)]
    else:
        return None
    output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(output) if doc]
