"""A bundle opened for use (rank 5): ONNX Runtime encoders with their engines (``loader``), CUDA I/O
(``gpu_io``), length-grouped batching (``length_groups``), and what runs a bundle to judge it:
`tonearm bundle verify` (``verify``), its metrics (``evaluate``) and the CLI of both (``cli``).

May import: ground modules, index.audio, index.metrics, index.bundle, index.engines, index.moments.
"""
