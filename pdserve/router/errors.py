"""Typed errors the router raises; the process edge maps each to a reply or a log line."""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error the router core raises."""


class UnknownWorkerError(RouterError):
    """A message names a worker that is not registered."""


class StaleEpochError(RouterError):
    """A message carries a role epoch that was retired or superseded; it must be dropped."""


class IdentityMismatchError(RouterError):
    """A worker's model identity or K/V ABI hash differs from the cluster's."""


class RoleMismatchError(RouterError):
    """A worker's role does not belong in the router's serving mode."""


class DuplicateRegistrationError(RouterError):
    """A worker registered the same role epoch twice."""


class UnknownRequestError(RouterError):
    """A completion, abort or publication names a request with no live route."""


class IllegalTransitionError(RouterError):
    """A state machine was asked for a transition its table does not allow."""


class LeakError(RouterError):
    """A resource ledger failed its integrity check."""
