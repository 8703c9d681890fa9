"""Integrations with training frameworks, imported by module path only (each imports its framework):

- :mod:`lowdiff.integrations.lightning`: ``LowDiffCallback`` for Lightning 2.x (``lightning.pytorch``);
- :mod:`lowdiff.integrations.transformers`: ``LowDiffTrainer``, a transformers ``Trainer`` that resumes from the
  lowdiff run directory.

``import lowdiff`` imports neither. Install them with ``pip install "lowdiff[integrations]"``.
"""
