"""What tests and benchmarks use to see the engine's CUDA path without a GPU
(``cuda_standin``: fake streams and events that check ordering and count host work)."""
