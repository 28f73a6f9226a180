"""The output head fused with the cross-entropy loss, chunk by chunk of tokens.

A plain head materialises logits for every token ([tokens, vocab] in the compute dtype),
then the loss makes fp32 copies of them (log-softmax and its gradient): 14 bytes per token
per vocabulary entry in bf16, 14.7 GB for Llama 3 8B at 8192 tokens. Here the logits of one
chunk of tokens exist at a time, and only while that chunk's loss and gradients are computed.

The gradients are computed in the forward, chunk by chunk, right after each chunk's loss
(as Liger's fused linear cross-entropy does): the backward then only scales them by the
incoming gradient. Recomputing each chunk's logits in the backward instead would hold the
same memory at the same moment (nothing runs between the head's forward and its backward)
and cost one more head matmul, a third more of the head's FLOPs. Every matmul runs in the
parameter dtype (bf16 in bf16 runs, like a plain ``nn.Linear``); the softmax, the loss and
its gradient are computed in fp32, as ``F.cross_entropy(logits.float(), ...)`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from yatrain.common import IGNORE_INDEX


def _loss_and_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss, d loss / d h, d loss / d weight) for h [N, dim], targets [N].

    Two chunk-sized buffers serve every chunk: the logits in the parameter dtype (later
    their gradient, cast back) and their fp32 copy (the same buffer in fp32 runs)."""
    valid = targets != ignore_index
    # 1 / (number of counted tokens), as a tensor: no host sync on GPUs.
    inv_count = valid.sum().clamp(min=1).reciprocal().to(torch.float32)
    safe = torch.where(valid, targets, 0).unsqueeze(1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    rows_max = min(chunk_tokens, h.shape[0])
    logits_buf = h.new_empty(rows_max, weight.shape[0], dtype=weight.dtype)
    fp32_buf = logits_buf
    if weight.dtype != torch.float32:
        fp32_buf = h.new_empty(rows_max, weight.shape[0], dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        h_c, valid_c = h[rows], valid[rows].unsqueeze(1)
        logits = logits_buf[: h_c.shape[0]]
        torch.mm(h_c, weight.t(), out=logits)  # [chunk, vocab] in the parameter dtype
        x = fp32_buf[: h_c.shape[0]]
        if x is not logits:
            x.copy_(logits)
        target_logit = x.gather(1, safe[rows])
        shift = x.amax(dim=1, keepdim=True)
        x.sub_(shift).exp_()
        total = x.sum(dim=1, keepdim=True)
        lse = total.log().add_(shift)
        loss += torch.where(valid_c, lse - target_logit, 0.0).sum()
        if not (need_h or need_w):
            continue
        # d loss / d logits = (softmax - one_hot(target)) / count, zero for ignored rows
        x.div_(total)
        x.scatter_add_(1, safe[rows], -valid_c.to(x.dtype))
        x.mul_(valid_c * inv_count)
        grad_logits = logits
        if x is not logits:
            grad_logits.copy_(x)  # back to the parameter dtype for the matmuls
        if need_h:
            torch.mm(grad_logits, weight, out=grad_h[rows])
        if need_w:  # accumulated in the parameter dtype, one rounding per chunk
            if start == 0:
                torch.mm(grad_logits.t(), h_c, out=grad_w)
            else:
                grad_w.addmm_(grad_logits.t(), h_c)
    return loss * inv_count, grad_h, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss, with its gradients computed in the forward and scaled in the backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, ignore_index: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w = _loss_and_grads(
            h, weight, targets, chunk_tokens, ignore_index, need_h, need_w
        )
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # Scaled in place: these tensors exist only to be handed to autograd here.
        if grad_h is not None:
            grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w.mul_(grad_loss.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight).float(), targets)`` (mean over tokens whose
    target is not ``ignore_index``) without holding logits for more than ``chunk_tokens``
    tokens at once. ``h`` is [..., dim], ``targets`` the matching [...] int64 token ids."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if h.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match hidden states {tuple(h.shape)}"
        )
    flat_h, flat_targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if not torch.is_grad_enabled():  # no graph (evaluation): the loss alone
        return _loss_and_grads(
            flat_h, weight, flat_targets, chunk_tokens, ignore_index, False, False
        )[0]
    return _LinearCrossEntropy.apply(flat_h, weight, flat_targets, chunk_tokens, ignore_index)


# The mean loss of a micro-batch: (model, inputs, targets, extra model arguments) -> loss.
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def model_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, extra: dict):
    """The model's own loss (what training uses): Llama's output head fused with the
    cross-entropy, chunk by chunk, never holding logits for every token."""
    return model(inputs, **extra, targets=targets)


def logits_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, extra: dict):
    """The plain loss: logits for every token, then ``cross_entropy`` (the benchmarks'
    common ground with FSDP2 and DDP)."""
    return cross_entropy(model(inputs, **extra), targets)
