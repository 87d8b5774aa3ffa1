"""Exceptions raised by tidal.store.

Bad input from the caller raises the built-in ``KeyError`` / ``ValueError`` / ``TypeError``
(or the subclasses below); failures of the service itself raise :class:`StoreError`.
"""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store could not do what was asked: a lost volume, a dropped connection, a timeout."""


class WaitExpiredError(StoreError):
    """A read waiting with ``wait=`` saw the version begin, but it was not completely written
    before the wait ended (the writer is slow or gone); asking again may succeed."""


class VolumeLostError(StoreError):
    """A storage volume holding the requested bytes is gone (its process died or left)."""


class ProtocolError(StoreError):
    """A peer sent a message that does not follow the wire schema (or exceeds a size limit)."""


class AuthError(StoreError):
    """The token sent by the client does not match the server's."""


class VersionNotFoundError(KeyError):
    """The key exists but the requested version does not (never written, evicted or deleted)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class KeyNotFoundError(KeyError):
    """The key was never written or has been deleted."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# Error classes a server may name in a reply; the client raises exactly these (no lookup of
# arbitrary names received from the network).
WIRE_ERRORS: dict[str, type[Exception]] = {
    "KeyNotFoundError": KeyNotFoundError,
    "VersionNotFoundError": VersionNotFoundError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "StoreError": StoreError,
    "VolumeLostError": VolumeLostError,
    "ProtocolError": ProtocolError,
    "AuthError": AuthError,
}
