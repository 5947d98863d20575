"""tonearm's torch-free library: what training, the CLI and the service share (docs/ARCHITECTURE.md).

Subpackages by concern, each importing only what lies below it (tests/test_import_rules.py):

====  =========================  =====================================================================
rank  package                    holds
====  =========================  =====================================================================
0     errors                     every user-facing error the library raises
1     languages, cpus, ids       language codes, usable CPUs, the id grammar of clips and added items
2     audio, metrics             decoding and formats; pure-numpy retrieval and moment metrics
3     bundle                     the bundle on disk: manifest, checksums, eval set, tokenizer
4     moments                    window scores to moments; the window-source protocol and its search
5     engines                    vector search (FAISS, Milvus — moment windows too —, filters)
6     items, runtime             added items (log, overlay, Milvus store); a bundle opened for use
7     catalogue                  embedding passes over a catalogue (decode workers, checkpoints, Ray)
====  =========================  =====================================================================
"""
