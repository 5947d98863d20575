"""Embedding passes over a catalogue (rank 6): the decode-beside-encode pass (``embed_pass``), its
content-keyed checkpoints (``checkpoint``), fp16 copies (``half_precision``), the long recordings' windows
(``moment_windows``), `tonearm index AUDIO_DIR` (``own_audio``) and the same passes on Ray (``ray_embed``,
``ray_connect``), whose windows go straight to Milvus with ``--milvus-uri`` (``milvus_pass_windows``).

May import: every other index package.
"""
