"""Bundle helpers for index tests; the session fixture ``tiny_bundle`` is in tests/conftest.py.

Tests that corrupt a bundle copy it first with :func:`copy_bundle`.
"""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.index.test_ray_embed import RayHead


def copy_bundle(source: Path, destination: Path) -> Path:
    """A writable copy of a bundle directory."""
    shutil.copytree(source, destination)
    for path in destination.rglob("*"):
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return destination


# ---------------------------------------------------------------- the Ray cluster of the --ray tests


@pytest.fixture(scope="package")
def ray_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HOME of the Ray processes of tests/index/test_ray_embed.py and test_ray_milvus.py: it holds a
    stale token, as on a machine where a local ``tonearm index --ray`` ran before, so every test there
    also checks that such a token does not stop the CLI from reaching a cluster started without token
    authentication."""
    from tests.index.test_ray_embed import _stale_token_home

    return _stale_token_home(tmp_path_factory.mktemp("ray_home"))


@pytest.fixture(scope="package")
def ray_cluster(ray_home: Path) -> Iterator[RayHead]:
    """A cluster without token authentication (RAY_AUTH_MODE=disabled: the stale token is not its own).
    Package scope: the two modules that use it run one after the other and share one cluster (one
    ``ray start --head`` and its shutdown less: the two modules took 136 s instead of 142 s on two
    cores); it stops after the package's last test."""
    from tests.index.test_ray_embed import _ray_env, _ray_head

    with _ray_head(_ray_env(ray_home, RAY_AUTH_MODE="disabled")) as head:
        yield head


@pytest.fixture(scope="package")
def ray_address(ray_cluster: RayHead) -> str:
    """:func:`ray_cluster`'s GCS address, ``127.0.0.1:PORT``."""
    return ray_cluster.address
