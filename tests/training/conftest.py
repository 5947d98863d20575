"""Fixtures of the training tests: the real-size models, presets and bundles (tests/real_size_models.py),
a real S3-compatible server (tests/s3_server.py)."""

from tests.real_size_models import (  # noqa: F401  (pytest fixtures, used by name)
    real_ast_dir,
    real_ast_xlmr_run,
    real_clap_dir,
    real_clap_pretrained_bundle,
    real_clap_run,
    real_manifest,
    real_marian_dir,
    real_minilm_dir,
    real_minilm_run,
    real_train_manifest,
    real_xlmr_dir,
)
from tests.s3_server import s3_endpoint  # noqa: F401  (pytest fixture, used by name)
