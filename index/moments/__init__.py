"""Moments in long recordings (SPEC §19, rank 4): window spans and their embeddings (``windows``), window
scores to moments (``postprocess``), the trained moment head's ONNX inference (``head``) and the
`tonearm evaluate --moments` measurement (``evaluate``).

May import: ground modules, index.audio, index.metrics, index.bundle.
"""
