"""Sampling the next token (``models.generate.choose``): at a temperature T the draws follow
softmax(logits / T), checked against the frequencies of seeded draws, and a temperature too
small to divide by is greedy, not an error."""

from __future__ import annotations

import torch

from yatrain.models.generate import Sampling, choose


def test_sampling_at_a_temperature_follows_softmax_of_logits_over_t():
    """At T = 0.5 and T = 2, the frequencies of 20,000 seeded draws are softmax(logits / T)
    (dividing twice would give softmax(logits / T^2): off by 0.1 and more)."""
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    draws = 20_000
    for temperature in (0.5, 2.0):
        generator = torch.Generator().manual_seed(0)
        counts = torch.zeros(4)
        for _ in range(draws):
            counts[choose(logits, Sampling(temperature=temperature), generator)] += 1
        want = torch.softmax(logits / temperature, dim=0)
        assert (counts / draws - want).abs().max() < 0.015, (temperature, counts / draws, want)


def test_a_tiny_temperature_is_greedy_not_an_error():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    for temperature in (1e-45, 1e-30, 5e-324):
        generator = torch.Generator().manual_seed(0)
        assert choose(logits, Sampling(temperature=temperature), generator) == 1
