"""The engine benchmark: ``cli`` (flags, main), ``harness`` (ranks, repeats, memory runs),
``contenders`` (yatrain, FSDP2, DDP, bare), ``report`` (tables and targets)."""
