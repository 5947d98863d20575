"""bench/real_size.py's peer rows (issue 32): one query source for tonearm and Infinity, the CLAP text
tower as a plain RoBERTa folder, tokens per query, and the like-for-like / PE-Audio tables."""

from __future__ import annotations

import json

import pytest

from bench.real_size import like_for_like, pretrained_table, query_tokens
from bench.service_load import QUERIES, _text_body, text_query
from tests.real_size_models import bpe_tokenizer, real_model_dir


def test_text_query_is_the_mix_made_unique_for_cold_text_and_is_what_tonearm_is_sent():
    assert text_query("text-warm", 2, 3) == QUERIES[5]
    cold = [text_query("text-cold", 1, i) for i in range(3)]
    assert len(set(cold)) == 3 and cold[0].startswith(QUERIES[1] + " 1-0-")
    assert json.loads(_text_body("text-warm", 0, 1)) == {"query": QUERIES[1], "k": 10}


def test_query_tokens_counts_special_tokens_and_cuts_to_the_limit(tmp_path):
    bpe_tokenizer(tmp_path, roberta_ids=True, max_length=512)
    full = query_tokens(tmp_path / "tokenizer.json")
    assert full > 20  # the served mix is longer than Infinity's CLAP cut
    assert query_tokens(tmp_path / "tokenizer.json", limit=20) == 20.0


def test_the_clap_text_tower_saved_as_roberta_gives_the_same_hidden_states(tmp_path):
    import torch
    from transformers import AutoTokenizer, ClapConfig, ClapModel, RobertaModel

    clap_dir = tmp_path / "real_models" / "clap"  # a small CLAP folder where real_model_dir("clap") looks
    clap_dir.mkdir(parents=True)
    torch.manual_seed(0)
    config = ClapConfig(
        text_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
        audio_config={"hidden_size": 24, "depths": [1, 1], "num_attention_heads": [1, 1],
                      "patch_embeds_hidden_size": 24, "window_size": 4, "spec_size": 64, "num_mel_bins": 16},
        projection_dim=16)
    ClapModel(config).save_pretrained(clap_dir)
    bpe_tokenizer(clap_dir, roberta_ids=True, max_length=512)
    (tmp_path / "real_models" / "clap.done").touch()

    folder = real_model_dir("clap_text_roberta", tmp_path)

    clap = ClapModel.from_pretrained(clap_dir).eval()
    roberta = RobertaModel.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    batch = tokenizer([text_query("text-cold", 0, 0)], return_tensors="pt")
    assert batch["input_ids"].shape[1] > 20  # a whole query, not CLAP's 20 tokens
    with torch.no_grad():
        expected = clap.text_model(**batch).last_hidden_state
        got = roberta(**batch).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _serve(server: str, clients: int, rps: float, tokens: float, **extra: object) -> dict:
    return {"kind": "serve", "preset": "clap", "server": server, "workload": "text-cold", "clients": clients,
            "rps": rps, "tokens": tokens, "command": "serve clap", "cpu": "cpu A", "date": "d", **extra}


def test_like_for_like_pairs_equal_tokens_and_precision_and_labels_the_20_token_row():
    rows = [_serve("tonearm", 1, 30.0, 38.4, command="older run"), _serve("infinity-roberta", 1, 1.0, 38.4,
                                                                          command="older run")]
    rows += [_serve(s, c, r * c, t) for s, r, t in (("tonearm", 20.0, 38.4), ("tonearm+int8-text", 60.0, 38.4),
                                                      ("infinity", 25.0, 20.0), ("infinity-roberta", 10.0, 38.4),
                                                      ("infinity-roberta-int8", 40.0, 38.4)) for c in (1, 16)]
    table = like_for_like(rows)
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| tonearm")}
    assert "20.0 / 10.0 = **2.00×**" in lines["| tonearm ÷ infinity-roberta"]  # the newest run, not the older one
    assert "60.0 / 40.0 = **1.50×**" in lines["| tonearm+int8-text ÷ infinity-roberta-int8"]
    assert "not like for like" in lines["| tonearm ÷ infinity"] and "38.4/20.0" in lines["| tonearm ÷ infinity"]
    assert like_for_like([_serve("tonearm", 1, 1.0, 38.4)]) == ""


@pytest.mark.parametrize("later_audio", [False, True])
def test_pretrained_table_takes_each_cell_from_the_newest_run(later_audio):
    base = {"cpu": "cpu A", "date": "d", "load": 1.0, "command": "c"}
    rows = [{**base, "kind": "build", "preset": "pe_audio", "export_s": 200.0,
             "onnx_mb": {"audio_encoder.onnx": 1135.9, "text_encoder.onnx": 1289.7}},
            {**base, "kind": "startup", "preset": "pe_audio", "server": "tonearm", "ready_s": 18.0, "rss_mib": 3100.0}]
    rows += [{**base, "kind": "serve", "preset": "pe_audio", "server": "tonearm", "workload": w, "clients": c,
              "rps": 0.11 if w == "audio" else 8.0} for w in ("text-cold", "audio") for c in (1, 8)]
    if later_audio:
        rows.append({**base, "kind": "serve", "preset": "pe_audio", "server": "tonearm", "workload": "audio",
                     "clients": 1, "rps": 0.131, "command": "c --seconds 30"})
    line = next(x for x in pretrained_table(rows).splitlines() if x.startswith("| pe_audio"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[3:5] == ["200.0", "audio 1.14 GB, text 1.29 GB"]
    assert cells[8:12] == ["8.0", "8.0", "0.13" if later_audio else "0.11", "0.11"]


def test_no_pretrained_rows_no_table():
    assert pretrained_table([]) == ""
