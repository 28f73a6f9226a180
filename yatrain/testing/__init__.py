"""What tests and benchmarks share: ranks started in fresh processes (``ranks``), tokenizers
made on the spot (``bpe``), and the engine's CUDA path seen without a GPU (``cuda_standin``:
fake streams and events that check ordering and count host work)."""
