"""Benchmark: `tonearm data translate` captions/s per core with an Opus-MT-size model on CPU.

Builds Helsinki-NLP/opus-mt-en-de's architecture at full size with random weights (74 M
parameters, tests/real_size_models.py) and a SentencePiece vocabulary trained here on
Clotho-like captions (so a caption is about as many tokens as under Opus-MT's), converts it to
CTranslate2, and times :class:`training.data.translate.Seq2SeqTranslator` — the code path
`tonearm data translate --model` runs — on one thread: transformers fp32, CTranslate2 fp32
and int8, greedy and beam 4. Random weights never emit the end token, so every translation
is exactly ``--out-tokens`` long (default 20: about a translated Clotho caption). Writes the
``translate_throughput`` section of docs/BENCHMARKS.md with the arithmetic for the captions
of Clotho + AudioCaps in seven languages.

    flock /tmp/tonearm-heavy.lock python bench/translate_throughput.py [--captions 256] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import cpu_model, publish_section  # noqa: E402

START = "<!-- bench:translate_throughput:start -->"
END = "<!-- bench:translate_throughput:end -->"
CORPUS_CAPTIONS = 300_000
LANGUAGES = 7

SUBJECTS = ["a dog", "a small child", "several people", "a man", "a woman", "a car", "a large truck", "the wind",
            "heavy rain", "a flock of birds", "an old door", "a train", "water", "a crowd", "a motorcycle", "a bell",
            "a baby", "someone", "the engine", "a cat", "footsteps", "thunder", "a machine", "a helicopter"]
VERBS = ["barks", "speaks", "is talking loudly", "passes by", "runs", "blows through the trees", "falls steadily",
         "chirps", "creaks open", "approaches and then leaves", "flows over rocks", "cheers", "revs its engine",
         "rings", "cries", "walks on gravel", "rumbles in the distance", "hums", "is whistling", "splashes"]
PLACES = ["in the background", "on a busy street", "in a quiet room", "near a river", "at a train station",
          "in the forest", "outside", "on a wooden floor", "in a large hall", "far away", "close to the microphone"]
LINKS = ["while", "as", "and", "before", "after"]


def caption(rng: random.Random) -> str:
    """A Clotho-like caption (8-20 words, about 12 on average)."""
    text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(PLACES)}"
    if rng.random() < 0.6:
        text += f" {rng.choice(LINKS)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)}"
    return text[0].upper() + text[1:] + "."


def timed(translator: object, texts: list[str], batch: int) -> float:
    translate = translator.translate  # type: ignore[attr-defined]
    translate(texts[:batch], "deu")  # warm-up (loads the model)
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        translate(texts[i:i + batch], "deu")
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captions", type=int, default=256, help="captions timed per configuration")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out-tokens", type=int, default=20, help="translation length in tokens")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args()

    import ctranslate2
    import torch
    import transformers

    from tests.real_size_models import save_marian
    from training.data.translate import Seq2SeqTranslator

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = random.Random(0)
    texts = [caption(rng) for _ in range(args.captions)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, ct2_dir = Path(tmp) / "opus-mt", Path(tmp) / "opus-mt-ct2"
        save_marian(model_dir, sentences=[caption(rng) for _ in range(5000)], pieces=1000, model_type="bpe")
        from transformers import AutoTokenizer

        tokens = [len(ids) for ids in AutoTokenizer.from_pretrained(model_dir)(texts)["input_ids"]]
        ctranslate2.converters.TransformersConverter(
            str(model_dir), copy_files=["source.spm", "target.spm", "vocab.json", "tokenizer_config.json"]
        ).convert(str(ct2_dir))
        configs = [
            ("transformers fp32, greedy", model_dir, "default", 1),
            ("CTranslate2 fp32, greedy", ct2_dir, "default", 1),
            ("CTranslate2 int8, greedy", ct2_dir, "int8", 1),
            ("transformers fp32, beam 4", model_dir, "default", 4),
            ("CTranslate2 int8, beam 4", ct2_dir, "int8", 4),
        ]
        rates = []
        for label, folder, compute, beams in configs:
            translator = Seq2SeqTranslator({"deu": folder}, batch_size=args.batch_size, beams=beams, threads=1,
                                           max_new_tokens=args.out_tokens, compute_type=compute)
            rate = timed(translator, texts, args.batch_size)
            rates.append((label, rate))
            print(f"{label}: {rate:.1f} captions/s", file=sys.stderr)
    load_after = os.getloadavg()[0]

    total = CORPUS_CAPTIONS * LANGUAGES
    words = statistics.mean(len(t.split()) for t in texts)
    lines = [
        START,
        "## translate_throughput — `tonearm data translate` captions/s per core, Opus-MT size on CPU",
        "",
        f"`flock /tmp/tonearm-heavy.lock python bench/translate_throughput.py --captions {args.captions}` · "
        f"{cpu_model()}, one thread · {dt.date.today().isoformat()} · load average {load_before:.2f} → "
        f"{load_after:.2f} (1-min, 2 cores; other sessions share the machine)",
        "",
        f"Opus-MT en-de's architecture at full size (74 M parameters) with random weights, through "
        f"`Seq2SeqTranslator` (the `--model` path). {args.captions} Clotho-like captions "
        f"({words:.1f} words, {statistics.mean(tokens):.1f} source tokens on average), batches of "
        f"{args.batch_size}, every translation exactly {args.out_tokens} tokens (random weights never stop "
        "early; a real model stops at the end of the sentence, so sentences shorter than that run faster).",
        "",
        f"| configuration | captions/s per core | core-hours for {CORPUS_CAPTIONS // 1000} k × {LANGUAGES} "
        f"= {total / 1e6:.1f} M translations | wall hours on 16 cores |",
        "|---|---:|---:|---:|",
    ]
    for label, rate in rates:
        hours = total / rate / 3600
        lines.append(f"| {label} | {rate:.1f} | {hours:,.0f} | {hours / 16:,.1f} |")
    lines += [
        "",
        "Arithmetic: core-hours = captions × languages / (captions/s per core) / 3600; one process per core "
        "(one `tonearm data translate --threads 1 --to LANG` per language, all sharing one `--cache`: "
        "docs/training.md, \"Make a multilingual corpus\"). The issue's ≈300 k captions is an upper bound for Clotho + AudioCaps "
        "(Clotho v2.1 has 29,645 captions, AudioCaps v1 about 57 k; duplicates are translated once), so "
        "the real corpus needs roughly a third of these hours. A GPU was not measured here, nor what int8 "
        "costs in translation quality (random weights have none).",
        END,
    ]
    publish_section("\n".join(lines), start=START, end=END, write=not args.no_write)


if __name__ == "__main__":
    main()
