"""The processes of a run: rank, device and process group (``process``), the ranks started
through torch's elastic launch API (``launch``), and what ends a run the machine broke: the
watchdog, the hang report and one-line machine failures.

Knows no model, engine or recipe.
"""
