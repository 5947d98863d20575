"""Items added through the API (rank 4): the id grammar (``ids``), the write-ahead item log (``log``), the
in-memory overlay searched beside a bundle (``overlay``), the Milvus item store (``milvus_store``), per-file
metadata (``file_metadata``) and `tonearm items export` (``export``).

May import: ground modules, index.bundle, index.engines.
"""
