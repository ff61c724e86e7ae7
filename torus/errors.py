"""Exceptions raised by torus collectives. Every message names the operation and the rank."""


class TorusError(RuntimeError):
    """Base class of torus' own runtime errors."""


class MismatchError(TorusError, ValueError):
    """Ranks called a collective with different arguments (raised on every rank, before any data moves)."""


class TimeoutError(TorusError):  # noqa: A001 - a torus-specific timeout, distinct from the builtin
    """A collective made no progress for ``timeout`` seconds (a dead or stuck peer)."""
