"""Mini-batch SGD with momentum and weight decay: torch.optim.SGD's update, without torch.optim.

The first step of any `torch.optim` optimizer imports `torch._dynamo` (its `zero_grad` and `step`
are wrapped to keep the compiler out), and with it ~800 modules (sympy, `torch.distributed`, the
ONNX exporter): ~80 MB in every process that trains, a third of a lean ClientApp's memory. `SGD`
performs the same operations in the same order as torch.optim.SGD's single-tensor path (the one
it takes on the CPU) with dampening 0 and without Nesterov: the same weights, bit for bit
(tests/test_training.py compares them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SGD:
    """`torch.optim.SGD(params, lr, momentum, weight_decay)`'s `zero_grad` and `step`.

    Parameters without a gradient are skipped (as torch does); a parameter's momentum buffer
    starts as its first (weight-decayed) gradient.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        """Drop every gradient (torch's default `set_to_none=True`)."""
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """θ ← θ − lr·b with b ← momentum·b + (g + wd·θ)."""
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            grad = param.grad
            if self.weight_decay != 0:
                grad = grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buffer = self._buffers[i]
                if buffer is None:
                    buffer = self._buffers[i] = grad.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(grad, alpha=1)
                grad = buffer
            param.add_(grad, alpha=-self.lr)
