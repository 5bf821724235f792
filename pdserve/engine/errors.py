"""Typed engine errors. `InvalidRequest` is the caller's fault (an API maps it to 400);
`IllegalTransition` and `PoolIntegrityError` are bugs and must never be swallowed."""


class EngineError(Exception):
    """Base class of engine errors."""


class InvalidRequest(EngineError, ValueError):
    """The request cannot be served as given (bad parameters, prompt too long, ...). `param` and
    `code`, when known, name the offending request field and an error code for the API's 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class IllegalTransition(EngineError, RuntimeError):
    """A state machine was asked for a transition its table does not allow."""


class PoolIntegrityError(EngineError, AssertionError):
    """A resource pool's accounting no longer adds up."""


class OutOfBlocks(EngineError, RuntimeError):
    """An allocation was attempted without a successful capacity check first."""
