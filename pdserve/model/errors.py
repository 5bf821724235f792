"""Errors raised while reading a model checkpoint from disk.

Contract: every `CheckpointError` names the file (or directory) it is about and the problem,
so a message read in a worker's log is actionable without a stack trace. It subclasses
`ValueError` (a bad checkpoint is bad input) and survives pickling across processes.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or inconsistent with its config."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Default pickling would call CheckpointError(message) and fail; rebuild from the parts.
        return (CheckpointError, (self.path, self.problem))
