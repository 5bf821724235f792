"""The HTTP layer's view of the serving contract (defined in `pdserve.router.contract`, the
lower layer that implements it, so that arrows keep pointing down)."""

from pdserve.router.contract import (  # noqa: F401 - re-exported names
    Backend,
    ErrorEvent,
    FinishEvent,
    GenerationEvent,
    GenerationRequest,
    Rejection,
    TokenEvent,
    WorkerView,
)
