"""Datasets (SPEC §2): the JSONL manifest, public-format converters, the synthetic corpus, loaders.

Modules: :mod:`.manifest` (ClipRecord, load/write), :mod:`.formats` (Clotho,
AudioCaps, WavCaps → manifest; ``tonearm data convert``), :mod:`.synth`
(``tonearm synth``), :mod:`.dataset` (training batches and evaluation views;
imports torch). Nothing is imported here so that light modules stay light.
"""
