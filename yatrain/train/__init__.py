"""The training loop and the components that decide its cadence.

``setup`` builds a ``Run``, ``loop`` steps it, ``step.train_step`` is one optimizer step.
Each periodic action is a component with ``due(step)``: the ``Checkpointer``, the
``Evaluator``, the ``StepMeter`` (whose records go through the ``Loggers`` fan-out) and the
profiler. Storage, output and the processes live below (``checkpoint``, ``output``,
``runtime``).
"""
