"""Pure-numpy metrics (docs/metrics.md): retrieval and cross-language consistency (``retrieval``),
moment retrieval (``moments``), paired comparison (``paired``) and their readable views (``report``) (rank 2).

May import: index.errors, index.languages.
"""
