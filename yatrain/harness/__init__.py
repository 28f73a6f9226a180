"""What tests and benchmarks share: ranks started in processes, tokenizers made on the spot.

Below ``yatrain.bench``, so the tests import it without depending on any benchmark.
"""
