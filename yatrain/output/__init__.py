"""A run's measurements written out: the ``metrics.jsonl`` record, the console line and
summary, the W&B and TensorBoard loggers, and ``yatrain report``'s charts and HTML page.

The loop's fan-out (``output.loggers``) decides what is logged and when; these modules only
write it.
"""
