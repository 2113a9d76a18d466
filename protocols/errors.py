"""Error families of the wire protocol.

`LocalProtocolError`: this process misused the API (say, encoding an oversized message).
`RemoteProtocolError`: a peer sent something we cannot accept. Both derive from
`ProtocolError`, so a receive loop can catch one base and drop the frame.
"""

from __future__ import annotations


class KvBrokerError(Exception):
    """Base of every error kvbroker raises on purpose."""


class ProtocolError(KvBrokerError):
    """A message could not be encoded or decoded."""

    code = "protocol"


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes that are not a valid message; drop them, never crash."""


class TruncatedMessage(RemoteProtocolError):
    code = "truncated"


class OversizedMessage(RemoteProtocolError):
    code = "oversized"


class VersionMismatch(RemoteProtocolError):
    code = "version"


class UnknownMessageType(RemoteProtocolError):
    code = "unknown_type"


class InvalidMessage(RemoteProtocolError):
    """Right tag, wrong field types or values."""

    code = "invalid"


class ChannelClosed(KvBrokerError):
    """The socket under a channel is closed; nothing more can be sent or received."""


class BrokerUnavailable(KvBrokerError):
    """The broker did not answer in time."""


class Refused(KvBrokerError):
    """The broker refused a request (bad registration, incompatible peer, ...)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class RendezvousError(KvBrokerError):
    """A peer's rendezvous data (to build a communicator) did not arrive or was unusable."""


class TransferFailed(KvBrokerError):
    """A transfer was aborted; `reason` says why, in one sentence."""

    def __init__(self, transfer_id: str, reason: str) -> None:
        super().__init__(f"transfer {transfer_id} failed: {reason}")
        self.transfer_id = transfer_id
        self.reason = reason


class TransferTimeout(TransferFailed):
    """A transfer's wait passed its deadline."""


class SendTimeout(TransferTimeout):
    """The data could not be sent in time."""


class RecvTimeout(TransferTimeout):
    """The data did not arrive in time."""
