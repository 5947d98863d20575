"""Everything that makes a bundle (SPEC §6, docs/models.md "How a bundle is made"), in one folder.

- :mod:`training.bundle.cli` — ``tonearm export``: a checkpoint or ``--pretrained MODEL_DIR``.
- :mod:`training.bundle.export` — a trained checkpoint's towers to ONNX, then the shared steps.
- :mod:`training.bundle.pretrained` (+ :mod:`~training.bundle.pretrained_family`) — a pretrained
  model folder (CLAP, PE-Audio) to ONNX with its own feature extractor, then the shared steps.
- :mod:`training.bundle.parts` — the shared steps: identity, catalogue pass, assembly, report, manifest.
- :mod:`training.bundle.onnx_export`, :mod:`training.bundle.quantize` — ONNX towers, dynamic int8.
- :mod:`training.bundle.step0` — centred-cosine parity of a tower against its reference model (used
  by exports and by a fine-tune's step-0 check).
"""
