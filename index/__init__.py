"""tonearm's torch-free library: what training, the CLI and the service share (docs/ARCHITECTURE.md).

Subpackages by concern, each importing only what lies below it (tests/test_import_rules.py):

====  =========================  =====================================================================
rank  package                    holds
====  =========================  =====================================================================
0     errors, languages, cpus    user-facing errors, language codes, usable CPUs (modules of this folder)
1     audio, metrics             decoding and formats; pure-numpy retrieval and moment metrics
2     bundle                     the bundle on disk: manifest, checksums, eval set, tokenizer
3     engines, moments           vector search (FAISS, Milvus, filters); window scores to moments
4     items, runtime             added items (log, overlay, Milvus store); a bundle opened for use
5     catalogue                  embedding passes over a catalogue (decode workers, checkpoints, Ray)
====  =========================  =====================================================================
"""
