"""yatrain: pretrain Llama-class models with a YaFSDP-style sharded data-parallel engine."""

__version__ = "0.1.0"
