"""`--devices all` counts the GPUs a process sees as CUDA does (issue 55, part 3): ``CUDA_VISIBLE_DEVICES``
unset is every GPU ``nvidia-smi -L`` lists; the empty string and ``-1`` are none; a list is cut at its
first entry that names no device; GPU UUIDs (or unique prefixes) and MIG UUIDs count; a device named twice
leaves none; a process sees at most one MIG device, and a GPU in MIG mode counts only as that one MIG device
(:func:`index.catalogue.embed_pass.visible_cuda_devices`). Pure functions: no GPU needed, < 1 s."""

from __future__ import annotations

import pytest

from index.catalogue import embed_pass
from index.catalogue.embed_pass import (
    PhysicalGpu,
    nvidia_smi_gpus,
    parse_devices,
    visible_cuda_devices,
)
from index.errors import TonearmError

LISTING = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8932f937-d72c-4106-c12f-20bd9faed9f6)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-8932aaaa-0000-4106-c12f-20bd9faed9f6)
GPU 2: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.20gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)
  MIG 3g.20gb     Device  1: (UUID: MIG-0b1e3c5a-1111-5de3-91c7-45d71c87eb3f)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-11112222-3333-4444-5555-666677778888)
"""
GPUS = nvidia_smi_gpus(LISTING)


def test_nvidia_smi_listing_is_read_with_uuids_and_mig_devices() -> None:
    assert [g.uuid for g in GPUS] == ["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
                                      "GPU-8932aaaa-0000-4106-c12f-20bd9faed9f6",
                                      "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77",
                                      "GPU-11112222-3333-4444-5555-666677778888"]
    assert GPUS[2].migs == ("MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", "MIG-0b1e3c5a-1111-5de3-91c7-45d71c87eb3f")
    assert nvidia_smi_gpus("") == [] and nvidia_smi_gpus("No devices were found\n") == []


@pytest.mark.parametrize(("value", "count"), [
    (None, 4),                    # unset: every GPU
    ("", 0),                      # set and empty: none (was counted as every GPU)
    ("-1", 0),                    # none (was counted as one)
    (" ", 0),
    ("0", 1), ("3,1", 2), ("0,1,2,3", 4),
    ("0,2,-1,1", 2),              # the CUDA guide's example: cut at the invalid entry
    ("0,7,1", 1),                 # an index past the last GPU is invalid
    ("0,,1", 1),                  # an empty entry is invalid
    ("1gpu,2", 2),                # read as strtoul does: "1gpu" is 1
    ("0,0", 0), ("1,GPU-8932aaaa", 0),  # a device named twice: none
    ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", 1),
    ("GPU-5d5b,GPU-1111", 2),     # unique prefixes
    ("GPU-8932,0", 0),            # an ambiguous prefix names no device
    ("GPU-ffff,0", 0),            # an unknown UUID names none
    ("2,GPU-1111", 2),            # indices and UUIDs in one list
    ("MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", 1),
    ("MIG-c6d4,MIG-0b1e", 1),     # CUDA enumerates one MIG device per process (was counted as two)
    ("MIG-GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77/1/0", 1),  # the CUDA 11.0 MIG form
    ("MIG-GPU-5d5ba0d6/x/0", 0),
    ("MIG-dead,0", 0),
])
def test_cuda_visible_devices_counts_as_cuda_does(value: str | None, count: int) -> None:
    assert visible_cuda_devices(value, GPUS) == count


MIG_LISTING = """\
GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaaaaaa-0000-0000-0000-000000000000)
  MIG 3g.40gb     Device  0: (UUID: MIG-aaaa0000-0000-0000-0000-000000000000)
  MIG 3g.40gb     Device  1: (UUID: MIG-aaaa1111-0000-0000-0000-000000000000)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-bbbbbbbb-0000-0000-0000-000000000000)
  MIG 7g.80gb     Device  0: (UUID: MIG-bbbb0000-0000-0000-0000-000000000000)
GPU 2: NVIDIA A100-SXM4-80GB (UUID: GPU-cccccccc-0000-0000-0000-000000000000)
GPU 3: NVIDIA A100-SXM4-80GB (UUID: GPU-dddddddd-0000-0000-0000-000000000000)
"""
MIG_GPUS = nvidia_smi_gpus(MIG_LISTING)


@pytest.mark.parametrize(("value", "count"), [
    (None, 3),                                # GPUs 2 and 3 whole, plus one MIG device for GPUs 0 and 1
    ("MIG-aaaa0000,MIG-aaaa1111", 1),         # two MIG devices of one GPU: one
    ("MIG-aaaa0000,MIG-bbbb0000", 1),         # two MIG devices of two GPUs: one
    ("MIG-aaaa0000,2", 2),                    # a MIG device plus a plain GPU
    ("3,MIG-bbbb0000,2", 3),
    ("MIG-aaaa0000,MIG-bbbb0000,2,3", 3),     # the second MIG device is passed over, the list goes on
    ("0", 1),                                 # a GPU in MIG mode by index: its one MIG device
    ("0,1", 1),                               # two GPUs in MIG mode: still one MIG device
    ("0,1,2,3", 3),
    ("GPU-aaaa,GPU-cccc", 2),                 # by UUID as by index
    ("0,MIG-aaaa0000", 1),                    # the MIG GPU and its MIG device: one
    ("MIG-GPU-aaaaaaaa-0000-0000-0000-000000000000/1/0,MIG-bbbb0000,3", 2),  # the CUDA 11.0 form is a MIG device
    ("MIG-aaaa0000,MIG-ffff,2", 1),           # an unknown MIG UUID still ends the list
    ("MIG-aaaa0000,2,MIG-aaaa0000", 0),       # a MIG device named twice: none
    ("2,3", 2),                               # plain GPUs as before
])
def test_a_process_sees_at_most_one_mig_device(value: str | None, count: int) -> None:
    assert visible_cuda_devices(value, MIG_GPUS) == count


def test_devices_all_plans_one_process_for_several_mig_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embed_pass.shutil, "which", lambda _name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(embed_pass.subprocess, "run",
                        lambda *a, **k: type("Done", (), {"stdout": MIG_LISTING})())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa0000,MIG-aaaa1111,MIG-bbbb0000")
    assert parse_devices("all", "cuda") == [0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa0000,3")
    assert parse_devices("all", "cuda") == [0, 1]


def test_without_a_listing_nothing_is_visible() -> None:
    assert visible_cuda_devices("0,1", []) == 0 and visible_cuda_devices(None, []) == 0
    assert visible_cuda_devices("0", [PhysicalGpu("")]) == 1  # a GPU line without a UUID still counts


def test_devices_all_with_nothing_visible_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embed_pass.shutil, "which", lambda _name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(embed_pass.subprocess, "run",
                        lambda *a, **k: type("Done", (), {"stdout": LISTING})())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(TonearmError, match="no CUDA device visible .CUDA_VISIBLE_DEVICES=''"):
        parse_devices("all", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0,-1,3")
    assert parse_devices("all", "cuda") == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert parse_devices("all", "cuda") == [0, 1, 2, 3]
