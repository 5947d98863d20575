"""The bundle on disk (docs/bundle.md): manifest schema, checksums and atomic publication
(``format``), the held-out eval set it carries (``evalset``) and its text tokenizer (``tokenizer``) (rank 3).

Reads files only; opening a bundle for use is ``index.runtime``. May import: ground modules, index.audio.
"""
