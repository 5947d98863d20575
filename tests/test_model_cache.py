"""tests/model_cache.py: the per-machine cache of the real-size test models and their exports
(keys, atomic builds, read-only entries, views, pruning, corruption found). Fast: tiny builds."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests import model_cache
from tests.model_cache import (
    cached,
    changed_entries,
    key_of,
    manifest_digest,
    materialize,
    tree_digest,
)


@pytest.fixture(autouse=True)
def _own_hand_outs(monkeypatch: pytest.MonkeyPatch) -> None:
    """This module's entries live in its tmp dirs: kept out of the session-end check of the real ones."""
    monkeypatch.setattr(model_cache, "_handed_out", {})


def write_model(directory: Path, text: str = "weights") -> None:
    (directory / "config.json").write_text("{}")
    (directory / "sub").mkdir()
    (directory / "sub" / "model.bin").write_text(text)


def other_builder(directory: Path) -> None:
    (directory / "config.json").write_text('{"other": true}')


def test_same_inputs_give_the_same_key_and_any_change_another() -> None:
    """Same inputs -> same key; a changed source, seed, version or dependency key -> a new key."""
    base = {"sources": [write_model, {"vocab": 10}], "seed": 0, "versions": {"torch": "2.0"}}
    key = key_of(**base)
    assert key == key_of(**dict(base)) and len(key) == model_cache.KEY_CHARS
    assert key_of(**{**base, "sources": [other_builder, {"vocab": 10}]}) != key  # builder source
    assert key_of(**{**base, "sources": [write_model, {"vocab": 11}]}) != key  # a config dict it uses
    assert key_of(**{**base, "seed": 1}) != key
    assert key_of(**{**base, "versions": {"torch": "2.1"}}) != key
    assert key_of(**base, depends={"clap": "abc"}) != key_of(**base, depends={"clap": "abd"})
    with pytest.raises(TypeError):
        key_of(sources=[object()])


def test_versions_name_python_and_absent_libraries() -> None:
    found = model_cache.versions("pytest", "no-such-distribution-here")
    assert found["pytest"] == pytest.__version__ and found["no-such-distribution-here"] == "absent"
    assert found["python"].count(".") == 2


def test_tree_and_manifest_digests_follow_contents_not_places(tmp_path: Path) -> None:
    """The export key's code digest follows file contents; a manifest's digest follows its audio's bytes
    wherever this session put the files."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    before = tree_digest(tmp_path, ["pkg/**/*.py"])
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert tree_digest(tmp_path, ["pkg/**/*.py"]) != before

    digests = []
    for place in ("one", "two/deeper"):
        folder = tmp_path / place
        (folder / "audio").mkdir(parents=True)
        (folder / "audio" / "a.wav").write_bytes(b"RIFF")
        (folder / "m.jsonl").write_text(json.dumps({"id": "a", "audio": "audio/a.wav", "split": "train",
                                                    "captions": {"eng": ["x"]}}) + "\n")
        digests.append(manifest_digest(folder / "m.jsonl"))
    assert digests[0] == digests[1]
    (tmp_path / "one" / "audio" / "a.wav").write_bytes(b"RIFX")
    assert manifest_digest(tmp_path / "one" / "m.jsonl") != digests[0]


def test_a_build_runs_once_and_its_entry_is_read_only(tmp_path: Path) -> None:
    calls = []

    def build(directory: Path) -> None:
        calls.append(directory)
        write_model(directory)

    entry = cached("toy", "k1", build, root=tmp_path)
    assert cached("toy", "k1", build, root=tmp_path) == entry == tmp_path / "toy-k1" and len(calls) == 1
    assert calls[0].parent == tmp_path and calls[0] != entry  # built beside it, then renamed
    marker = json.loads((tmp_path / "toy-k1.done").read_text())
    assert set(marker["files"]) == {"config.json", "sub/model.bin"}
    for path in (entry, entry / "sub", entry / "config.json", entry / "sub" / "model.bin"):
        assert model_cache.is_read_only(path), oct(path.stat().st_mode)
    if os.access(entry / "config.json", os.W_OK):
        return  # root (CAP_DAC_OVERRIDE) ignores the bits: the done marker's listing catches its writes
    with pytest.raises(PermissionError):
        (entry / "config.json").write_text("changed")
    with pytest.raises(PermissionError):
        (entry / "new_file").write_text("x")


def test_a_build_that_raises_leaves_no_marker_and_no_half_folder(tmp_path: Path) -> None:
    def broken(directory: Path) -> None:
        write_model(directory)
        raise RuntimeError("out of memory halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        cached("toy", "k1", broken, root=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.lock"]
    # the next try builds from scratch
    assert (cached("toy", "k1", write_model, root=tmp_path) / "sub" / "model.bin").read_text() == "weights"


def test_a_killed_builds_leftovers_and_a_marker_without_folder_are_rebuilt(tmp_path: Path) -> None:
    (tmp_path / ".toy-k1.abc.tmp").mkdir()  # what SIGKILL mid-build leaves
    (tmp_path / ".toy-k1.abc.tmp" / "half").write_text("x")
    (tmp_path / "toy-k1.done").write_text(json.dumps({"files": {}}))  # a marker whose folder is gone
    entry = cached("toy", "k1", write_model, root=tmp_path)
    assert entry.is_dir() and not (tmp_path / ".toy-k1.abc.tmp").exists()


def test_a_new_key_prunes_the_old_entry_of_the_same_name_only(tmp_path: Path) -> None:
    old = cached("toy", "k1", write_model, root=tmp_path)
    kept = cached("toy_text", "k1", write_model, root=tmp_path)  # 'toy_text-…' is not an entry of 'toy'
    new = cached("toy", "k2", other_builder, root=tmp_path)
    assert new.is_dir() and kept.is_dir() and not old.exists() and not (tmp_path / "toy-k1.done").exists()


def test_concurrent_users_build_once(tmp_path: Path) -> None:
    calls = []
    started = threading.Barrier(4)

    def build(directory: Path) -> None:
        calls.append(1)
        write_model(directory)

    def use() -> None:
        started.wait()
        cached("toy", "k1", build, root=tmp_path)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def test_views_copy_small_files_and_hard_link_large_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache, "LINK_MIN_BYTES", 5)
    entry = cached("toy", "k1", lambda d: write_model(d, "large weights"), root=tmp_path / "cache")
    view = materialize(entry, tmp_path / "view")
    small, large = view / "config.json", view / "sub" / "model.bin"
    assert small.stat().st_ino != (entry / "config.json").stat().st_ino
    assert not model_cache.is_read_only(small)
    small.write_text('{"a test": "may rewrite it"}')  # its own copy: the entry is unchanged
    assert large.stat().st_ino == (entry / "sub" / "model.bin").stat().st_ino and model_cache.is_read_only(large)
    (view / "sub" / "new.txt").write_text("x")  # the view's folders are its own
    assert changed_entries() == []


def test_a_write_through_a_view_is_found_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-place write into a hard-linked file (root ignores 0444) changes the entry: the session-end
    check names it and drops its marker, and the next hand-out rebuilds it anyway."""
    monkeypatch.setattr(model_cache, "LINK_MIN_BYTES", 5)
    calls = []

    def build(directory: Path) -> None:
        calls.append(1)
        write_model(directory, "large weights")

    view = cached("toy", "k1", build, root=tmp_path / "cache", view=tmp_path / "view")
    entry, large = tmp_path / "cache" / "toy-k1", view / "sub" / "model.bin"
    large.chmod(0o644)
    large.write_text("corrupted!!!!")
    assert changed_entries() == [entry] and not (tmp_path / "cache" / "toy-k1.done").exists()
    cached("toy", "k1", build, root=tmp_path / "cache")
    assert len(calls) == 2 and (entry / "sub" / "model.bin").read_text() == "large weights"
    # a changed entry whose marker is still there is rebuilt at hand-out too
    os.chmod(entry / "sub", 0o755)
    (entry / "sub" / "extra").write_text("a file a test left")
    cached("toy", "k1", build, root=tmp_path / "cache")
    assert len(calls) == 3 and not (entry / "sub" / "extra").exists()


def test_the_cache_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(model_cache.CACHE_ENV, raising=False)
    assert model_cache.cache_root(tmp_path) == Path("~/.cache/tonearm/test-models").expanduser()
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert model_cache.cache_root(tmp_path) == tmp_path / "elsewhere"
    monkeypatch.setenv(model_cache.CACHE_ENV, "off")
    assert model_cache.cache_root(tmp_path / "session") == tmp_path / "session"


def test_the_real_size_keys_cover_the_builders_and_chain_clap(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/real_size_models.py: every model has a distinct key; clap_text_roberta's includes clap's,
    so a changed CLAP builder rebuilds both; a library version change rebuilds the models using it."""
    from tests import real_size_models as real

    real.model_key.cache_clear()
    keys = {name: real.model_key(name) for name in real.BUILDERS}
    assert len(set(keys.values())) == len(keys) and set(real.MODEL_INPUTS) == set(real.BUILDERS)
    real.model_key.cache_clear()
    monkeypatch.setitem(real.MODEL_INPUTS, "clap", ([other_builder], real.MODEL_INPUTS["clap"][1]))
    assert real.model_key("clap") != keys["clap"] and real.model_key("clap_text_roberta") != keys["clap_text_roberta"]
    assert real.model_key("ast") == keys["ast"]
    real.model_key.cache_clear()
    monkeypatch.undo()
    real_versions = model_cache.versions
    monkeypatch.setattr(model_cache, "versions",
                        lambda *names: {**real_versions(*names), **({"sentencepiece": "0.0"} if "sentencepiece" in names else {})})
    assert real.model_key("marian") != keys["marian"] and real.model_key("ast") == keys["ast"]
    real.model_key.cache_clear()
