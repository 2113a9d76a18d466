"""Signed grants: proof that a transfer_id was handed out by someone holding the shared key.

Why: a decode instance reachable by clients loads whatever transfer its request names.
Without a grant, a client that guesses or sees another request's ``transfer_id`` can send
that id to D and have D claim the KV staged for someone else (the others' requests then
fail or recompute). With ``grant_key_file`` set on P and D (the same secret), D loads only
for a request whose ``kv_transfer_params["grant"]`` verifies.

A grant is one ASCII string, ``v1.<expires>.<prompt>.<mac>``:

    expires   Unix time (whole seconds) after which the grant is refused.
    prompt    digest of the prompt's token ids (the connector's `tokens_digest`), or
              empty: a grant minted where the prompt is not known as token ids (a
              gateway that forwards text) binds no prompt; the broker still checks
              that P's and D's prompts agree.
    mac       HMAC-SHA256, hex, over the version, transfer_id, prefill instance,
              prompt and expiry, length-prefixed so no field can spill into another.

The transfer_id and the prefill instance are not repeated in the grant: they travel
beside it (``transfer_id``, ``prefill_instance_id`` or ``remote_engine_id``) and are
verified through the MAC. Pure functions, stdlib only (no torch, no vLLM, no IO but
`read_key`): the connector and the gateway both import it. Clocks are parameters.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import uuid

from .errors import KvBrokerError

__all__ = [
    "GRANT_PARAM",
    "MAX_GRANT",
    "MIN_KEY_BYTES",
    "GrantKeyError",
    "mint",
    "new_transfer_id",
    "read_key",
    "sign",
    "verify",
]

VERSION = "v1"
GRANT_PARAM = "grant"  # its key in kv_transfer_params
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
MAX_FIELD = 128  # transfer ids and instance ids are at most this long on the wire
MAX_GRANT = 256  # longer strings are refused before any parsing
_HEX = frozenset("0123456789abcdef")


class GrantKeyError(KvBrokerError, ValueError):
    """The grant key file cannot be used; the message says what to change."""


def read_key(path: str | os.PathLike[str], what: str = "grant key file") -> bytes:
    """The shared secret in `path` (surrounding whitespace stripped); `what` names the
    setting in the error message.

    Raises:
        GrantKeyError: the file cannot be read or holds fewer than 16 bytes.
    """
    try:
        with open(path, "rb") as f:
            key = f.read(MAX_KEY_BYTES + 1).strip()
    except OSError as exc:
        raise GrantKeyError(f"{what} {str(path)!r} cannot be read ({exc.strerror}); point it at the shared secret.") from None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise GrantKeyError(
            f"{what} {str(path)!r} must hold a secret of {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, "
            f"e.g. the output of `openssl rand -hex 32`; it holds {len(key)}."
        )
    return key


def new_transfer_id(prefix: str = "tx") -> str:
    """A fresh, unguessable transfer id (122 random bits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _mac(key: bytes, transfer_id: str, prefill: str, prompt: str, expires: int) -> str:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in (VERSION, transfer_id, prefill, prompt, str(expires)):
        data = part.encode()
        h.update(len(data).to_bytes(4, "big"))
        h.update(data)
    return h.hexdigest()


def sign(key: bytes, *, transfer_id: str, prefill: str, prompt: str = "", expires: float) -> str:
    """The grant for `transfer_id`, staged (or to be staged) by instance `prefill`.

    Args:
        key: the shared secret (`read_key`).
        transfer_id: the id D will load by.
        prefill: the prefill instance's id (what D gets as ``prefill_instance_id`` or
            ``remote_engine_id``).
        prompt: the prompt's token digest, or "" to bind no prompt.
        expires: Unix time after which D refuses it (rounded up to a whole second).

    Raises:
        ValueError: a field too long or holding a '.' (the grant's separator) in `prompt`.
    """
    if len(transfer_id) > MAX_FIELD or len(prefill) > MAX_FIELD or len(prompt) > MAX_FIELD or "." in prompt:
        raise ValueError("transfer_id, prefill and prompt must be at most 128 characters, and prompt without '.'")
    until = int(-(-expires // 1))
    return f"{VERSION}.{until}.{prompt}.{_mac(key, transfer_id, prefill, prompt, until)}"


def mint(key: bytes, *, prefill: str, ttl_s: float, now: float, prompt: str = "", prefix: str = "tx") -> tuple[str, str]:
    """A new transfer id and its grant, valid for `ttl_s` from `now` (what a gateway calls)."""
    transfer_id = new_transfer_id(prefix)
    return transfer_id, sign(key, transfer_id=transfer_id, prefill=prefill, prompt=prompt, expires=now + ttl_s)


def verify(key: bytes, grant: object, *, transfer_id: str, prefill: str, prompt: str, now: float) -> str | None:
    """Why `grant` does not entitle this request to load `transfer_id`, or None when it does.

    Never raises: any value a client sends (wrong type, huge, garbage) gives a reason.

    Args:
        grant: the ``grant`` value of the request's kv_transfer_params, as received.
        transfer_id, prefill: the request's transfer id and the prefill instance it names.
        prompt: the digest of this request's prompt token ids ("" when unknown).
        now: Unix time.
    """
    if grant is None:
        return "the request carries no grant, and this instance loads only granted transfers"
    if not isinstance(grant, str) or len(grant) > MAX_GRANT:
        return "its grant is not a grant string"
    parts = grant.split(".")
    if len(parts) != 4 or parts[0] != VERSION:
        return f"its grant is not a {VERSION} grant"
    _, until_s, signed_prompt, mac = parts
    if not until_s.isascii() or not until_s.isdigit() or len(until_s) > 12 or len(mac) != 64 or not _HEX.issuperset(mac):
        return "its grant is malformed"
    until = int(until_s)
    expected = _mac(key, transfer_id, prefill, signed_prompt, until)
    if not hmac.compare_digest(expected, mac):
        return "its grant does not verify (another key, another transfer_id or prefill instance, or altered)"
    if now > until:
        return f"its grant expired {now - until:.0f} s ago"
    if signed_prompt and signed_prompt != prompt:
        return "its grant was made for another prompt"
    return None
