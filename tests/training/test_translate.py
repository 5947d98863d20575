"""`tonearm data translate`: alignment, cache, resume, the chat endpoint over real HTTP, full-size Marian."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from index.errors import TonearmError
from tonearm.cli import main
from training.data.manifest import ClipRecord, load_manifest, read_manifest, write_manifest
from training.data.translate import (
    ChatTranslator,
    TranslationCache,
    parse_json_array,
    suspicion,
    translate_records,
)

ENG = [
    ["a dog barks twice", "a dog is barking", "rain falls on a tin roof"],
    ["a car engine starts", "a dog barks twice"],  # a caption shared with the first clip
    ["people talk in a busy cafe"],
]


def _manifest(tmp_path: Path, *, fra_on_last: bool = False) -> Path:
    records = []
    for i, captions in enumerate(ENG):
        texts: dict[str, list[str]] = {"eng": list(captions)}
        if fra_on_last and i == len(ENG) - 1:
            texts["fra"] = ["des gens parlent"]
        records.append(ClipRecord(f"clip{i}", tmp_path / f"clip{i}.wav", texts, "train", {"n": i}))
        (tmp_path / f"clip{i}.wav").write_bytes(b"x")
    path = tmp_path / "manifest.jsonl"
    write_manifest(records, path)
    return path


def _fake(lang: str, text: str) -> str:
    """What the test translators answer: recognisable, position-checkable, in the right script."""
    if lang == "jpn":
        return f"翻訳{len(text)}です"
    if lang == "zho":
        return f"翻译{len(text)}"
    return f"{lang}:{text}"


class CountingTranslator:
    """A pure-Python translator (no weights): records every caption it is asked for."""

    concurrency = 1

    def __init__(self, *, empty_for: str = "", fail_after: int | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.empty_for, self.fail_after = empty_for, fail_after

    def key_for(self, target: str) -> str:
        return "counting-v1"

    def translate(self, texts: Sequence[str], target: str) -> list[str]:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt  # what Ctrl-C does mid-run
        self.calls += [(target, t) for t in texts]
        return ["" if t == self.empty_for else _fake(target, t) for t in texts]

    def close(self) -> None:
        pass


def test_alignment_existing_translations_and_empty_outputs(tmp_path: Path) -> None:
    rows = read_manifest(_manifest(tmp_path, fra_on_last=True), languages=None)
    translator = CountingTranslator(empty_for="a car engine starts")
    cache = TranslationCache(tmp_path / "cache.sqlite")
    records, reports = translate_records([r for _, r in rows], translator, cache, ["fra", "jpn"], batch_size=2,
                                         progress=False)
    # position i of every language is the translation of English caption i
    assert records[0].captions["fra"] == [f"fra:{t}" for t in ENG[0]]
    assert records[0].captions["jpn"] == [_fake("jpn", t) for t in ENG[0]]
    # an empty output drops that clip's language (never shifts positions)
    assert "fra" not in records[1].captions and "jpn" not in records[1].captions
    assert reports["fra"].clips_without == 1 and reports["fra"].counts["empty"] == 1
    # existing translations are kept unless --replace
    assert records[2].captions["fra"] == ["des gens parlent"]
    assert reports["fra"].kept_existing == 1 and reports["jpn"].kept_existing == 0
    # the shared caption is translated once per language
    assert translator.calls.count(("fra", "a dog barks twice")) == 1
    assert reports["fra"].unique == 4 and reports["fra"].captions == 5
    assert records[0].meta == {"n": 0} and records[0].split == "train"
    replaced, _ = translate_records([r for _, r in rows], translator, cache, ["fra"], batch_size=2,
                                    replace=True, progress=False)
    assert replaced[2].captions["fra"] == [f"fra:{ENG[2][0]}"]
    assert rows[2][1].captions["fra"] == ["des gens parlent"]  # the input records are left as they were


def test_interrupted_run_resumes_from_the_cache(tmp_path: Path) -> None:
    manifest, out = _manifest(tmp_path), tmp_path / "out.jsonl"
    records = [r for _, r in read_manifest(manifest, languages=None)]
    cache_path = tmp_path / "cache.sqlite"
    first = CountingTranslator(fail_after=3)  # batches of 2: two batches stored, the third interrupted
    cache = TranslationCache(cache_path)
    with pytest.raises(KeyboardInterrupt):
        translate_records(records, first, cache, ["fra", "deu"], batch_size=2, progress=False)
    cache.close()
    assert len(first.calls) == 4
    second = CountingTranslator()
    cache = TranslationCache(cache_path)
    done, reports = translate_records(records, second, cache, ["fra", "deu"], batch_size=2, progress=False)
    assert not set(first.calls) & set(second.calls), "a cached caption was translated again"
    assert reports["fra"].cached == 4 and reports["fra"].translated == 1
    assert reports["deu"].translated == 5
    # a third run translates nothing and gives the same manifest
    third = CountingTranslator()
    again, _ = translate_records(records, third, cache, ["fra", "deu"], batch_size=2, progress=False)
    assert third.calls == [] and [r.captions for r in again] == [r.captions for r in done]
    # another translator key does not reuse these entries
    assert cache.get_many("other", "fra", ["a dog barks twice"]) == {}
    write_manifest(again, out)
    loaded = load_manifest(out, languages=["eng", "fra", "deu"])
    assert [len(r.captions["deu"]) for r in loaded] == [len(c) for c in ENG]


def test_suspicious_outputs() -> None:
    assert suspicion("a dog barks", "", "fra") == "empty"
    assert suspicion("a dog barks", "A dog barks.", "fra") == "copied"
    assert suspicion("a dog barks", "a dog barks", "jpn") == "copied"
    assert suspicion("a dog barks", "inu ga hoeru", "jpn") == "wrong_script"
    assert suspicion("a dog barks", "犬が吠える", "jpn") is None
    assert suspicion("a dog barks", "犬が吠える", "zho") == "wrong_script"  # kana: Japanese, not Chinese
    assert suspicion("a dog barks", "狗在叫", "zho") is None
    assert suspicion("a dog barks", "狗在叫", "deu") == "wrong_script"
    assert suspicion("a dog barks", "ein Hund " * 20, "deu") == "too_long"
    assert suspicion("a dog barks", "un chien aboie", "fra") is None


def test_parse_json_array() -> None:
    assert parse_json_array('```json\n["un", "deux"]\n```', 2) == ["un", "deux"]
    assert parse_json_array('["un"]', 2) is None
    assert parse_json_array("un, deux", 2) is None
    assert parse_json_array('["un", 2]', 2) is None


# ------------------------------------------------------------------ the chat endpoint, real HTTP


class ChatServer:
    """A local server speaking the chat-completions protocol (no LLM can run here): it answers
    each caption with :func:`_fake`, and can fail on purpose."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail_status: list[int] = []  # statuses answered to the next requests, in order
        self.broken_batches = 0  # next batch replies that are not a JSON array
        self.fail_after: int | None = None  # answer 500 once this many requests were answered
        self.answers: dict[str, dict[str, str]] = {}  # lang → caption → answer instead of _fake's
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                dead = server.fail_after is not None and len(server.requests) > server.fail_after
                if server.fail_status or dead:
                    status = server.fail_status.pop(0) if server.fail_status else 500
                    self.send_response(status)
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "not now"}}')
                    return
                system, user = body["messages"][0]["content"], body["messages"][1]["content"]
                name = re.search(r"into (.+?)\.", system)
                lang = {"French": "fra", "Japanese": "jpn", "German": "deu", "Finnish": "fin"}[name.group(1) if name else ""]
                if "JSON array" in system:
                    if server.broken_batches:
                        server.broken_batches -= 1
                        content = "Sure! Here are the translations: ..."
                    else:
                        content = "```json\n" + json.dumps([answer(lang, t) for t in json.loads(user)],
                                                           ensure_ascii=False) + "\n```"
                else:
                    content = answer(lang, user)
                reply = {"id": "x", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}]}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def answer(lang: str, text: str) -> str:
            return server.answers.get(lang, {}).get(text) or _fake(lang, text)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def _endpoint_args(server: ChatServer, manifest: Path, out: Path, *extra: str) -> list[str]:
    return ["data", "translate", str(manifest), "--to", "fra,jpn", "--out", str(out), "--endpoint", server.url,
            "--endpoint-model", "some-llm", "--batch-size", "2", "--retry-wait", "0.01", "--no-progress", *extra]


def test_endpoint_end_to_end_with_retries_and_fallback(tmp_path: Path, chat_server: ChatServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_LLM_KEY", "sk-test")
    chat_server.fail_status = [503, 429]  # retried
    chat_server.broken_batches = 1  # one caption at a time for that batch
    manifest, out = _manifest(tmp_path), tmp_path / "out" / "multi.jsonl"
    assert main(_endpoint_args(chat_server, manifest, out, "--api-key-env", "TEST_LLM_KEY",
                               "--concurrency", "2")) == 0
    records = load_manifest(out, languages=["eng", "fra", "jpn"])
    for record, eng in zip(records, ENG, strict=True):
        assert record.captions["fra"] == [f"fra:{t}" for t in eng]
        assert record.captions["jpn"] == [_fake("jpn", t) for t in eng]
    first = chat_server.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test"
    assert first["model"] == "some-llm" and first["temperature"] == 0.0
    singles = [r for r in chat_server.requests if "JSON array" not in r["messages"][0]["content"]]
    assert len(singles) == 4  # the broken batch's two captions + each language's last batch of one
    report = json.loads((out.parent / "multi.jsonl.report.json").read_text(encoding="utf-8"))
    assert report["fra"]["translated"] == 5 and report["jpn"]["counts"]["wrong_script"] == 0
    # rerun: everything from the cache, no request
    sent = len(chat_server.requests)
    assert main(_endpoint_args(chat_server, manifest, out)) == 0
    assert len(chat_server.requests) == sent


def test_endpoint_errors_are_clear(tmp_path: Path, chat_server: ChatServer) -> None:
    chat_server.fail_status = [401]
    with pytest.raises(TonearmError, match=r"answered HTTP 401.*check the key in --api-key-env"):
        ChatTranslator(chat_server.url, model="m", retries=0).translate(["a", "b"], "fra")
    chat_server.fail_status = [503] * 3
    translator = ChatTranslator(chat_server.url, model="m", retries=2, retry_wait=0.01)
    with pytest.raises(TonearmError, match=r"no answer after 3 attempts \(last: HTTP 503.*run the same command again"):
        translator.translate(["a", "b"], "fra")
    with pytest.raises(TonearmError, match="--lang-code fin=CODE_OR_NAME"):
        ChatTranslator(chat_server.url, model="m").translate(["a"], "fin")
    named = ChatTranslator(chat_server.url, model="m", lang_names={"fin": "Finnish"})
    assert named.translate(["a dog", "rain"], "fin") == ["fin:a dog", "fin:rain"]
    dead = ChatTranslator("http://127.0.0.1:9/v1", model="m", retries=0)
    with pytest.raises(TonearmError, match="ConnectError"):
        dead.translate(["a"], "fra")


def test_cli_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = _manifest(tmp_path)
    base = ["data", "translate", str(manifest), "--out", str(tmp_path / "o.jsonl")]
    assert main([*base, "--to", "fra"]) == 2
    assert "choose one translator" in capsys.readouterr().err
    assert main([*base, "--to", "fr", "--endpoint", "http://x", "--endpoint-model", "m"]) == 2
    assert "not an ISO 639-3 code" in capsys.readouterr().err
    assert main([*base, "--to", "fra", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


# ------------------------------------------------------------------ full-size Marian (random weights)


def test_marian_full_size_end_to_end(tmp_path: Path, real_marian_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Opus-MT en-de at full size through the code path real weights take: per-language folders."""
    manifest, out = _manifest(tmp_path), tmp_path / "marian.jsonl"
    argv = ["data", "translate", str(manifest), "--to", "deu,jpn", "--out", str(out),
            "--model", f"deu={real_marian_dir}", "--model", f"jpn={real_marian_dir}",
            "--max-new-tokens", "4", "--batch-size", "8", "--no-progress"]
    assert main(argv) == 0
    records = load_manifest(out, languages=["eng", "deu", "jpn"])
    assert [len(r.captions["deu"]) for r in records] == [len(c) for c in ENG]
    assert records[0].captions["deu"][0] == records[1].captions["deu"][1]  # same caption, same translation
    report = json.loads(out.with_name("marian.jsonl.report.json").read_text(encoding="utf-8"))
    # random weights answer with Latin-script pieces: every jpn output is flagged
    assert report["jpn"]["counts"]["wrong_script"] == 6 and report["deu"]["counts"]["wrong_script"] == 0
    assert report["deu"]["translated"] == 5
    # a one-pair Opus-MT folder cannot be the folder for every language (it would answer in its own)
    capsys.readouterr()
    assert main([*argv[:7], "--model", str(real_marian_dir), "--no-progress"]) == 2
    assert "one-pair Marian (Opus-MT) model: name its target language" in capsys.readouterr().err


def test_marian_multi_target_tags(tmp_path: Path, real_marian_dir: Path) -> None:
    """opus-mt-en-mul style: one folder, the target chosen by a ``>>xxx<<`` tag in front of the source."""
    from training.data.translate import Seq2SeqTranslator

    folder = tmp_path / "en-mul"
    folder.mkdir()
    for item in real_marian_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "vocab.json").unlink()
    vocab = json.loads((real_marian_dir / "vocab.json").read_text(encoding="utf-8"))
    for tag, old in ((">>fra<<", "▁w5000"), (">>cmn_Hans<<", "▁w5001")):
        vocab[tag] = vocab.pop(old)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    translator = Seq2SeqTranslator({"*": folder}, max_new_tokens=3)
    tokenizer = translator._load(folder)[0]
    assert translator._marian_token(tokenizer, "fra") == ">>fra<<"
    assert translator._marian_token(tokenizer, "zho") == ">>cmn_Hans<<"
    assert tokenizer(">>fra<< a dog barks")["input_ids"][0] == 5000
    assert len(translator.translate(["a dog barks", "rain falls"], "fra")) == 2
    with pytest.raises(TonearmError, match=r"no >>deu<< token .*--lang-code deu=CODE"):
        translator.translate(["a dog barks"], "deu")


def test_marian_ctranslate2_conversion_gives_the_same_translations(tmp_path: Path, real_marian_dir: Path) -> None:
    """The same full-size model converted to CTranslate2 (``model.bin``) translates like transformers."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from training.data.translate import Seq2SeqTranslator

    ct2_dir = tmp_path / "ct2"
    ctranslate2.converters.TransformersConverter(
        str(real_marian_dir), copy_files=["source.spm", "target.spm", "vocab.json", "tokenizer_config.json"]
    ).convert(str(ct2_dir))
    texts = ["a dog barks twice", "rain falls on a tin roof"]
    torch_out = Seq2SeqTranslator({"deu": real_marian_dir}, max_new_tokens=5).translate(texts, "deu")
    ct2 = Seq2SeqTranslator({"deu": ct2_dir}, max_new_tokens=5)
    assert ct2.key_for("deu") != Seq2SeqTranslator({"deu": real_marian_dir}, max_new_tokens=5).key_for("deu")
    ct2_out = ct2.translate(texts, "deu")
    # CTranslate2's max_decoding_length counts the end token; compare the common words
    assert [o.split()[:4] for o in ct2_out] == [o.split()[:4] for o in torch_out]


def test_endpoint_run_stopped_by_the_server_resumes(tmp_path: Path, chat_server: ChatServer,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The server dies after two requests: the run stops in one line, keeping both batches; the rerun
    sends only what is left and writes the same manifest as an uninterrupted run."""
    manifest, out = _manifest(tmp_path), tmp_path / "multi.jsonl"
    args = ["data", "translate", str(manifest), "--to", "fra", "--out", str(out), "--endpoint", chat_server.url,
            "--endpoint-model", "m", "--batch-size", "2", "--concurrency", "1", "--retries", "0"]
    chat_server.fail_after = 2
    assert main(args) == 2
    chat_server.fail_after = None
    err = capsys.readouterr().err
    assert "answered HTTP 500" not in err and "no answer after 1 attempt (last: HTTP 500" in err
    assert "translate fra: 2/5 captions" in err  # progress on stderr
    assert not out.exists() and len(chat_server.requests) == 3
    assert main(args) == 0
    resent = [json.loads(r["messages"][1]["content"]) if "JSON array" in r["messages"][0]["content"]
              else [r["messages"][1]["content"]] for r in chat_server.requests[3:]]
    assert sum(len(batch) for batch in resent) == 1  # only the fifth unique caption
    records = load_manifest(out, languages=["eng", "fra"])
    assert [r.captions["fra"] for r in records] == [[f"fra:{t}" for t in eng] for eng in ENG]


# ------------------------------------------------------------------ the other families


@pytest.mark.parametrize(("config", "tokenizer_class", "family"), [
    ({"model_type": "marian"}, "MarianTokenizer", "marian"),
    ({"model_type": "m2m_100"}, "M2M100Tokenizer", "m2m100"),
    ({"model_type": "m2m_100"}, "NllbTokenizer", "nllb"),
    ({"model_type": "t5"}, "T5Tokenizer", "madlad"),
    ({"add_source_bos": False}, "NllbTokenizerFast", "nllb"),  # a CTranslate2 folder: its own config.json
    ({"model_type": "bert"}, "BertTokenizer", None),
])
def test_family_detection(tmp_path: Path, config: dict[str, Any], tokenizer_class: str, family: str | None) -> None:
    from index.errors import DataError
    from training.data.translate import detect_family

    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}),
                                                    encoding="utf-8")
    if family is None:
        with pytest.raises(DataError, match="not a supported translation model .Marian/Opus-MT, M2M100, NLLB"):
            detect_family(tmp_path)
    else:
        assert detect_family(tmp_path) == family


def test_nllb_many_to_many_folder(tmp_path: Path) -> None:
    """A (tiny) NLLB folder: one model for every language, the target its forced first token."""
    from index.errors import DataError
    from training.data.translate import Seq2SeqTranslator

    _save_m2m100(tmp_path, tokenizer="nllb")
    translator = Seq2SeqTranslator({"*": tmp_path}, max_new_tokens=3, lang_codes={"fin": "xyz_Latn"})
    assert len(translator.translate(["a dog barks", "rain"], "zho")) == 2
    assert translator._loaded is not None and translator._loaded[1].src_lang == "eng_Latn"
    tokenizer, ids = translator.generate_ids(["a dog barks", "rain"], "zho")
    assert [row[1] for row in ids] == [tokenizer.convert_tokens_to_ids("zho_Hans")] * 2
    with pytest.raises(DataError, match="has no language token 'xyz_Latn' for fin"):
        translator.translate(["a dog barks"], "fin")


# ------------------------------------------------------------------ dropping flagged outputs

FLAGGED = {  # what the test translator answers instead of a good translation (fra)
    "a dog is barking": "A dog is barking.",  # copied (clip0, position 1 of 3)
    "a car engine starts": "un moteur " * 12,  # too_long (clip1, position 0)
}


class FlaggingTranslator(CountingTranslator):
    """:class:`CountingTranslator` that answers :data:`FLAGGED` for those captions into French."""

    def translate(self, texts: Sequence[str], target: str) -> list[str]:
        outputs = super().translate(texts, target)
        if target != "fra":
            return outputs
        return [FLAGGED.get(t, out) for t, out in zip(texts, outputs, strict=True)]


def test_drop_flagged_keeps_positions_and_other_captions(tmp_path: Path) -> None:
    from training.data.translate import Checks

    rows = [r for _, r in read_manifest(_manifest(tmp_path), languages=None)]
    cache = TranslationCache(tmp_path / "cache.sqlite")
    kept, kept_report = translate_records(rows, FlaggingTranslator(), cache, ["fra", "deu"], batch_size=8,
                                          progress=False)
    # without --drop-flagged: reported, written
    assert kept[0].captions["fra"][1] == "A dog is barking." and kept[1].captions["fra"][0].startswith("un moteur")
    assert kept_report["fra"].counts["copied"] == 1 and kept_report["fra"].counts["too_long"] == 1
    assert kept_report["fra"].dropped == dict.fromkeys(("empty", "copied", "wrong_script", "too_long"), 0)
    dropped, report = translate_records(rows, FlaggingTranslator(), cache, ["fra", "deu"], batch_size=8,
                                        progress=False, drop={"copied", "too_long"})
    fra = report["fra"]
    # clip0: position 0 kept, the copy at 1 dropped, position 2 (good) left behind: no hole in the positions
    assert dropped[0].captions["fra"] == [f"fra:{ENG[0][0]}"]
    # clip1: its first output ran away: no fra at all, but its English and German stay
    assert "fra" not in dropped[1].captions
    assert dropped[1].captions["eng"] == ENG[1] and dropped[1].captions["deu"] == [f"deu:{t}" for t in ENG[1]]
    assert dropped[2].captions["fra"] == [f"fra:{ENG[2][0]}"]
    assert fra.dropped == {"empty": 0, "copied": 1, "too_long": 1, "wrong_script": 0}
    assert fra.left_behind == 2 and fra.written == 2 and fra.clips_without == 1
    assert report["deu"].written == 6 and sum(report["deu"].dropped.values()) == 0
    # only the flag named is dropped
    one, one_report = translate_records(rows, FlaggingTranslator(), cache, ["fra"], batch_size=8, progress=False,
                                        drop={"copied"})
    assert one[1].captions["fra"][0].startswith("un moteur") and one_report["fra"].dropped["copied"] == 1
    assert one_report["fra"].dropped["too_long"] == 0
    # the thresholds: a looser --max-length-ratio lets the long output through, unflagged
    loose, loose_report = translate_records(rows, FlaggingTranslator(), cache, ["fra"], batch_size=8,
                                            progress=False, drop={"too_long"}, checks=Checks(max_length_ratio=8))
    assert loose_report["fra"].counts["too_long"] == 0 and loose[1].captions["fra"][0].startswith("un moteur")


def test_flag_thresholds() -> None:
    from index.errors import DataError
    from training.data.translate import Checks, parse_drop

    near = "the dog barks twice"
    assert suspicion("a dog barks twice", near, "fra") is None  # default: only an identical copy
    assert suspicion("a dog barks twice", near, "fra", Checks(copy_similarity=0.85)) == "copied"
    assert suspicion("a dog barks twice", "un chien aboie", "fra", Checks(copy_similarity=0.5)) is None
    mixed = "犬が barking loudly"  # 2 of 15 letters Japanese
    assert suspicion("a dog barks", mixed, "jpn") == "wrong_script"
    assert suspicion("a dog barks", mixed, "jpn", Checks(min_script_share=0.1)) is None
    assert suspicion("a dog barks", "ein Hund bellt und bellt", "deu", Checks(max_length_ratio=0.1)) == "too_long"
    assert suspicion("a dog barks", "ein Hund bellt und bellt", "deu") is None
    assert parse_drop(None) == frozenset() and parse_drop("all") == {"copied", "wrong_script", "too_long"}
    assert parse_drop("copied, too_long") == {"copied", "too_long"}
    with pytest.raises(DataError, match="--drop-flagged 'runaway': expected nothing"):
        parse_drop("runaway")
    with pytest.raises(DataError, match="--min-script-share 1.5: expected a number above 0 and at most 1.0"):
        Checks(min_script_share=1.5)
    with pytest.raises(DataError, match="--max-length-ratio 0.0: expected a number above 0"):
        Checks(max_length_ratio=0.0)


def test_drop_flagged_cli_report(tmp_path: Path, chat_server: ChatServer, capsys: pytest.CaptureFixture[str],
                                 caplog: pytest.LogCaptureFixture) -> None:
    chat_server.answers = {"fra": dict(FLAGGED)}
    manifest, out = _manifest(tmp_path), tmp_path / "multi.jsonl"
    assert main(_endpoint_args(chat_server, manifest, out, "--drop-flagged")) == 0
    err = capsys.readouterr().err
    fra_row = next(line.split() for line in err.splitlines() if line.startswith("fra "))
    # empty, copied, wrong_script, too_long (flagged/dropped), written, left_behind, clips_without
    assert fra_row[5:] == ["0", "1/1", "0", "1/1", "2", "2", "1"], err
    report = json.loads(out.with_name("multi.jsonl.report.json").read_text(encoding="utf-8"))
    assert report["fra"]["dropped"] == {"empty": 0, "copied": 1, "wrong_script": 0, "too_long": 1}
    assert report["fra"]["left_behind"] == 2 and report["jpn"]["written"] == 6
    records = load_manifest(out, languages=["eng", "fra", "jpn"])
    assert "fra" not in records[1].captions and records[1].captions["jpn"]
    assert all("A dog is barking." not in r.captions.get("fra", []) for r in records)
    # the cache keeps the raw outputs: rerun without --drop-flagged writes them, no request sent
    sent = len(chat_server.requests)
    assert main(_endpoint_args(chat_server, manifest, out)) == 0
    assert len(chat_server.requests) == sent
    assert load_manifest(out, languages=["eng", "fra", "jpn"])[0].captions["fra"][1] == "A dog is barking."
    assert "flagged outputs written into the manifest (fra 2)" in caplog.text


# ------------------------------------------------------------------ tiny many-to-many models: weights and forcing

TINY = {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32}


def _spm_model() -> bytes:
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([t for c in ENG for t in c] * 4), model_writer=model,
                                   vocab_size=40, hard_vocab_limit=False, character_coverage=1.0, minloglevel=2)
    return model.getvalue()


def _save_m2m100(folder: Path, *, seed: int = 0, tokenizer: str = "m2m100") -> None:
    """A tiny random M2M100 with an ``M2M100Tokenizer`` (its 100 ``__xx__`` codes), or an ``NllbTokenizer``."""
    import torch
    from transformers import (
        M2M100Config,
        M2M100ForConditionalGeneration,
        M2M100Tokenizer,
        NllbTokenizer,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok: Any
    if tokenizer == "nllb":
        tok = NllbTokenizer()  # the 200 language codes and the special tokens
    else:
        import sentencepiece as spm

        (folder / "sentencepiece.bpe.model").write_bytes(_spm_model())
        processor = spm.SentencePieceProcessor(model_file=str(folder / "sentencepiece.bpe.model"))
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for i in range(processor.get_piece_size()):
            vocab.setdefault(processor.id_to_piece(i), len(vocab))
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        tok = M2M100Tokenizer(str(folder / "vocab.json"), str(folder / "sentencepiece.bpe.model"))
    tok.save_pretrained(folder)
    # M2M100's 100 codes and 8 made-up words follow the vocabulary: 256 rows hold them all
    assert tokenizer == "nllb" or tok.convert_tokens_to_ids("__zu__") < 256 - 8
    torch.manual_seed(seed)
    M2M100ForConditionalGeneration(M2M100Config(
        vocab_size=len(tok) if tokenizer == "nllb" else 256, pad_token_id=tok.pad_token_id, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, **TINY,
    )).save_pretrained(folder)


MADLAD_CODES = ("<2fr>", "<2de>", "<2ja>", "<2zh>")


def _save_madlad(folder: Path) -> None:
    """A tiny random T5 with a ``T5Tokenizer`` whose vocabulary has MADLAD-400's ``<2xx>`` tokens."""
    import sentencepiece as spm
    import torch
    from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

    processor = spm.SentencePieceProcessor(model_proto=_spm_model())
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(processor.id_to_piece(i), processor.get_score(i)) for i in range(3, processor.get_piece_size())]
    vocab += [(code, 0.0) for code in MADLAD_CODES]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.add_tokens(list(MADLAD_CODES), special_tokens=True)  # one token each, as in MADLAD's own vocabulary
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(vocab_size=len(vocab), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                        num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
                               ).save_pretrained(folder)


def test_cache_key_follows_the_weights(tmp_path: Path) -> None:
    """A model re-saved with other weights in the same folder is translated afresh; an unchanged or
    copied folder reuses the cache; a file's sha256 is read once and remembered in the cache."""
    import shutil

    from training.data.translate import Seq2SeqTranslator, model_files, sha256_file

    folder = tmp_path / "m2m100"
    _save_m2m100(folder, seed=0)
    rows = [r for _, r in read_manifest(_manifest(tmp_path), languages=None)]
    cache = TranslationCache(tmp_path / "cache.sqlite")

    def run(model: Path) -> tuple[str, dict[str, Any]]:
        translator = Seq2SeqTranslator({"*": model}, max_new_tokens=3, digest=cache.file_digest)
        _, reports = translate_records(rows, translator, cache, ["fra"], batch_size=8, progress=False)
        return translator.key_for("fra"), reports["fra"].__dict__

    first_key, first = run(folder)
    assert first["translated"] == 5
    assert run(folder) == (first_key, {**first, "translated": 0, "cached": 5})
    weights = folder / "model.safetensors"
    before = weights.read_bytes()
    _save_m2m100(folder, seed=1)  # re-trained: same config, same size, other bytes
    assert weights.read_bytes() != before and len(weights.read_bytes()) == len(before)
    second_key, second = run(folder)
    assert second_key != first_key and second["translated"] == 5
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert run(copy)[0] == second_key  # the bytes make the key, not the path
    # the remembered digest is used while the file's stamp holds (a planted one shows it)
    stamp = weights.resolve().stat()
    cache.db.execute("UPDATE file_digests SET sha256='planted' WHERE path=?", (str(weights.resolve()),))
    assert cache.file_digest(weights) == "planted"
    weights.write_bytes(weights.read_bytes())  # written again: new mtime/ctime → read again
    assert weights.stat().st_mtime_ns != stamp.st_mtime_ns or weights.stat().st_ctime_ns != stamp.st_ctime_ns
    assert cache.file_digest(weights) == sha256_file(weights)
    assert {p.name for p in model_files(folder)} >= {"model.safetensors", "config.json", "vocab.json",
                                                     "sentencepiece.bpe.model", "tokenizer_config.json"}
    cache.close()


def test_cache_key_follows_every_option_that_changes_an_output(tmp_path: Path) -> None:
    """Issue 49: ``--lang-code zho=zh_Hant`` (another target code), another source language and, for an
    endpoint, another language name give other cache keys; a code given for another language does not."""
    from training.data.translate import Seq2SeqTranslator

    folder = tmp_path / "m2m100"
    _save_m2m100(folder)

    def key(**options: Any) -> str:
        return Seq2SeqTranslator({"*": folder}, max_new_tokens=3, **options).key_for("zho")

    plain = key()
    assert key(lang_codes={"zho": "zh_Hant"}) != plain != key(source="fra")
    assert key(lang_codes={"deu": "de"}) == plain
    chat = ChatTranslator("http://127.0.0.1:9/v1/chat/completions", model="m", lang_names={"zho": "Traditional Chinese"})
    assert chat.key_for("zho") != chat.key_for("deu") == ChatTranslator(
        "http://127.0.0.1:9/v1/chat/completions", model="m").key_for("deu")


def test_m2m100_forces_the_target_language_token(tmp_path: Path) -> None:
    from index.errors import DataError
    from training.data.translate import Seq2SeqTranslator

    _save_m2m100(tmp_path)
    translator = Seq2SeqTranslator({"*": tmp_path}, max_new_tokens=3)
    for lang, code in (("fra", "__fr__"), ("jpn", "__ja__"), ("zho", "__zh__")):
        tokenizer, ids = translator.generate_ids(["a dog barks twice", "rain"], lang)
        # generate's rows: the decoder start (</s>), then the forced language token
        assert [row[:2] for row in ids] == [[2, tokenizer.convert_tokens_to_ids(code)]] * 2, lang
    assert tokenizer.src_lang == "en" and tokenizer("a dog")["input_ids"][0] == tokenizer.convert_tokens_to_ids("__en__")
    assert len(translator.translate(["a dog barks"], "fra")) == 1
    with pytest.raises(DataError, match="has no language token '__xx__' for fra"):
        Seq2SeqTranslator({"*": tmp_path}, max_new_tokens=3, lang_codes={"fra": "xx"}).translate(["a"], "fra")


def test_madlad_prefixes_the_target_language_token(tmp_path: Path) -> None:
    from index.errors import DataError
    from training.data.translate import Seq2SeqTranslator, detect_family

    _save_madlad(tmp_path)
    assert detect_family(tmp_path) == "madlad"
    translator = Seq2SeqTranslator({"*": tmp_path}, max_new_tokens=3)
    seen: list[list[list[int]]] = []
    model = translator._load(tmp_path)[1]
    hook = model.get_encoder().register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(kwargs["input_ids"].tolist()), with_kwargs=True)
    try:
        for lang in ("fra", "jpn"):
            translator.translate(["a dog barks twice", "rain"], lang)
    finally:
        hook.remove()
    tokenizer = translator._load(tmp_path)[0]
    # what the encoder was fed: <2fr> (then <2ja>) first in every row, the caption after it
    assert [[row[0] for row in batch] for batch in seen] == [[tokenizer.convert_tokens_to_ids("<2fr>")] * 2,
                                                             [tokenizer.convert_tokens_to_ids("<2ja>")] * 2]
    assert tokenizer.decode(seen[0][0][1:], skip_special_tokens=True) == "a dog barks twice"
    with pytest.raises(DataError, match="has no language token '<2es>' for spa"):
        translator.translate(["a dog barks"], "spa")


def test_ctranslate2_nllb_forces_the_target_language_prefix(tmp_path: Path) -> None:
    """A tiny NLLB converted to CTranslate2: the hypothesis starts with the target language token given
    as ``target_prefix``, the token transformers forces on the unconverted folder.

    (An M2M100 does not convert here: ctranslate2 4.8's converter reads the language tokens from
    ``special_tokens_map["additional_special_tokens"]``, which transformers 5 no longer fills.)
    """
    ctranslate2 = pytest.importorskip("ctranslate2")
    from training.data.translate import Seq2SeqTranslator, detect_family

    folder, ct2_dir = tmp_path / "hf", tmp_path / "ct2"
    _save_m2m100(folder, tokenizer="nllb")
    ctranslate2.converters.TransformersConverter(
        str(folder), copy_files=["tokenizer.json", "tokenizer_config.json"]).convert(str(ct2_dir))
    assert (ct2_dir / "model.bin").is_file() and detect_family(ct2_dir) == "nllb"
    ct2, hf = Seq2SeqTranslator({"*": ct2_dir}, max_new_tokens=4), Seq2SeqTranslator({"*": folder}, max_new_tokens=4)
    for lang, code in (("zho", "zho_Hans"), ("fra", "fra_Latn"), ("jpn", "jpn_Jpan")):
        tok, ids = ct2.generate_ids(["a dog barks twice", "rain"], lang)
        wanted = tok.convert_tokens_to_ids(code)
        assert [row[0] for row in ids] == [wanted] * 2, lang
        assert [row[1] for row in hf.generate_ids(["a dog barks twice", "rain"], lang)[1]] == [wanted] * 2
    assert tok.src_lang == "eng_Latn"
    assert tok.convert_ids_to_tokens(tok.encode("a dog"))[0] == "eng_Latn"  # the source CTranslate2 is given
    assert ct2.key_for("zho") != hf.key_for("zho")
