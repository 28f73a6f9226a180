"""Benchmarks: side-by-side measurements whose ratios the README and docs/benchmarks.md quote.

Each benchmark is a module with a ``main`` (``python -m bench.loop``, or the shims
``python scripts/bench_*.py``): ``loop`` (the training loop against a bare PyTorch loop),
``engine`` (the engine against FSDP2, DDP and a bare step; a harness and its contenders),
``checkpoint`` (save and load time), ``tokenization`` (prepare-data's throughput by workers),
``document_mask`` (the cost of ``data.document_mask``), ``seed_table`` (the planner against
YaFSDP's published runs). Shared parts: ``measure`` (statistics, process memory, tables),
``traffic`` (bytes sent in collectives), ``bare`` (the plain PyTorch step every baseline
uses), ``pretrain_cli`` (one ``yatrain pretrain`` in a child process); the rank launcher
the tests use too is ``yatrain.testing.ranks``. Outside the library: nothing in yatrain
imports it, and it is not installed (``python scripts/bench_*.py`` finds it beside the shim;
``python -m bench.X`` needs ``PYTHONPATH=scripts``).
"""
