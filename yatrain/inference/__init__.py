"""What is done with a finished checkpoint: ``yatrain eval`` (held-out loss, computed the
way its run computed it) and ``yatrain generate`` (text, in one process, no engine).
"""
