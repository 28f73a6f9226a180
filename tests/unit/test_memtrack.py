"""The live-tensor tracker's categories: what the peak was made of, kept at the peak."""

from __future__ import annotations

import gc

import torch

from yatrain.plan.memtrack import UNSORTED, LiveTensorTracker


def test_the_peak_keeps_the_categories_it_was_made_of():
    """Each storage counts under the category set when it is made; the copy taken at the
    peak stays as it was while later storages come and go below it, and adds up to it."""
    with LiveTensorTracker(category="a") as mem:
        a = torch.empty(100)
        mem.category = "b"
        b = torch.empty(50)
        assert mem.by_category == {"a": 400, "b": 200}
        del b
        gc.collect()
        mem.category = "c"
        c = torch.empty(20)  # below the peak: the peak's copy is unchanged
        assert mem.by_category == {"a": 400, "b": 0, "c": 80}
        assert (mem.peak, mem.peak_by_category) == (600, {"a": 400, "b": 200})
        d = torch.empty(1000)  # a new peak: a new copy
        assert mem.peak_by_category == {"a": 400, "b": 0, "c": 4080}
        assert sum(mem.peak_by_category.values()) == mem.peak == mem.current
        assert a.numel() + c.numel() + d.numel() == 1120


def test_adopted_tensors_keep_the_category_they_came_with():
    before = torch.ones(10)
    also = torch.ones(5)
    with LiveTensorTracker() as mem:
        mem.adopt([before, before[2:]], "weights")  # a view: the same storage, once
        mem.adopt([before, also])
        assert mem.by_category == {"weights": 40, UNSORTED: 20}
        mem.reset_peak()
        assert mem.peak_by_category == {"weights": 40, UNSORTED: 20}


def test_a_storage_known_later_moves_at_the_peak_only_if_it_was_live_then():
    """``classify``: a storage live at the peak moves there and now; one made after the
    peak moves now only; one not counted is ignored."""
    outside = torch.ones(3)
    with LiveTensorTracker(category="temp") as mem:
        early = torch.empty(100)
        spike = torch.empty(500)
        del spike
        gc.collect()
        late = torch.empty(50)
        assert mem.peak_by_category == {"temp": 2400}
        mem.classify([early, late, outside], "gradients")
        assert mem.peak_by_category == {"temp": 2000, "gradients": 400}
        assert mem.by_category == {"temp": 0, "gradients": 600}
        mem.classify([early], "gradients")  # already there: nothing moves twice
        assert mem.peak_by_category == {"temp": 2000, "gradients": 400}
        assert sum(mem.peak_by_category.values()) == mem.peak
        assert late.numel() == 50
