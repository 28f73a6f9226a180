"""Context parallelism: one window's tokens split over CP ranks.

``group`` holds the collectives (the sequence gather and its reduce-scatter), ``split`` cuts a
micro-batch into this rank's chunks, and ``attention`` attends the local chunks to the
gathered keys and values. Between the model and the loop: it knows the model's attention
interface, the loop knows it only through ``ContextParallel``."""
