"""A regularised softmax (multinomial logistic) regression, trained full-batch with Adam in numpy.

Contract: `train(x, y, classes, ...)` is deterministic for given inputs (no sampling; fixed
initialisation at zero) and returns `SoftmaxModel(weights [F, G], bias [G])` minimising mean
cross entropy + l2/2 * ||W||^2. `predict` gives the arg-max class of each row; `proba` the
class probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SoftmaxModel:
    weights: np.ndarray  # [F, G] float32
    bias: np.ndarray  # [G] float32

    def logits(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weights + self.bias  # [N, G]

    def proba(self, x: np.ndarray) -> np.ndarray:
        z = self.logits(x)
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.argmax(self.logits(x), axis=1)  # [N]


def train(x: np.ndarray, y: np.ndarray, classes: int, l2: float = 1e-3, steps: int = 300,
          lr: float = 0.05) -> SoftmaxModel:
    """x [N, F] float32, y [N] int labels in [0, classes)."""
    n, f = x.shape
    w = np.zeros((f, classes), dtype=np.float64)
    b = np.zeros(classes, dtype=np.float64)
    onehot = np.zeros((n, classes))
    onehot[np.arange(n), y] = 1.0
    state = [np.zeros_like(w), np.zeros_like(w), np.zeros_like(b), np.zeros_like(b)]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / n  # [N, G]
        grads = (x.T @ g + l2 * w, g.sum(axis=0))
        for i, (param, grad) in enumerate(zip((w, b), grads)):
            m, v = state[2 * i], state[2 * i + 1]
            m *= beta1
            m += (1 - beta1) * grad
            v *= beta2
            v += (1 - beta2) * grad * grad
            param -= lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    return SoftmaxModel(w.astype(np.float32), b.astype(np.float32))
