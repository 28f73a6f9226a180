"""The recipe: its schema (``schema``: YAML into checked dataclasses; ``config``: the
dataclasses), loading with ``--set`` overrides (``load``), the cross-field checks (``checks``),
and the recipe against the job it runs in (``topology``)."""
