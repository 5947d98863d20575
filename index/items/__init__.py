"""Items added through the API (rank 5): the write-ahead item log (``log``), the
in-memory overlay searched beside a bundle (``overlay``), the Milvus item store (``milvus_store``), per-file
metadata (``file_metadata``) and `tonearm items export` (``export``).

The id grammar they share with bundle clips is a ground module, index.ids. May import: ground modules, index.bundle, index.engines.
"""
