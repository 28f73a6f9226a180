"""Checkpoint storage: sharded DCP saves and loads, manifests, checksums, safe loading, and
Hugging Face weights in (``init_from``, ``hf_source``) and out (``hf_export``).

When to save is the loop's business (``train.checkpointer``); this package only stores and
reads, and ``manifest.open_checkpoint`` is the one door every reader goes through.
"""
