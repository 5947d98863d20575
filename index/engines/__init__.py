"""Vector search engines over a bundle's vectors (rank 4): FAISS in memory and on disk, the backend
interface (``vector_index``), Milvus collections (``milvus_index``) and the metadata filter language
(``filters``) both engines evaluate.

May import: ground modules, index.bundle.
"""
