"""The files that make a bundle (SPEC §6, docs/models.md "How a bundle is made"), all in this folder.

- :mod:`training.bundle.cli` — ``tonearm export``: a checkpoint or ``--pretrained MODEL_DIR``.
- :mod:`training.bundle.assemble` — **the one assembly**: :func:`~training.bundle.assemble.assemble_bundle`
  runs an export's steps in one order inside a staging folder, writes the indices, id files, held-out set
  and windows, builds the manifest (the only :class:`~index.bundle.format.BundleManifest` built in
  ``training``) and publishes the bundle.
- :mod:`training.bundle.export` — a trained checkpoint's side: its towers to ONNX checked against
  PyTorch, its audio preparation and held-out set (``TrainedSteps``, ``trained_model``).
- :mod:`training.bundle.pretrained` (+ :mod:`training.bundle.pretrained_family`) — a pretrained model
  folder's side (CLAP, PE-Audio): its encoders to ONNX with its own feature extractor, checked against the
  model's own embeddings (``PretrainedSteps``, ``pretrained_model``).
- :mod:`training.bundle.parts` — the shared pieces: identity, clip selection, the catalogue pass
  (checkpointed, resumable), indices and id files, fp16 and quantization records.
- :mod:`training.bundle.onnx_export`, :mod:`training.bundle.quantize` — ONNX towers, dynamic int8.
- :mod:`training.bundle.step0` — centred-cosine parity of a tower against its reference model (used
  by exports and by a fine-tune's step-0 check).

``export`` and ``pretrained`` never import each other; neither builds a manifest itself
(tests/training/test_bundle_assembly.py). An index-only bundle (`tonearm index`) is made torch-free by
:mod:`index.catalogue.own_audio` from its source bundle's manifest.
"""
