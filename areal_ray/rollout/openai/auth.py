"""Who may use the OpenAI endpoint, and how much one request may send: the checks the
endpoint (deployments/openai_api.py) makes before it reads or parses anything.

Why: the endpoint runs generation on the run's rollout replicas and keeps every
session's tokens in its one replica's memory. Without a key, anyone who reaches the
port could fill its memory, flood generation, or (before sessions were bounded)
evict the live sessions of a running episode. So every request carries a bearer key
(`rollout.openai.api_key`: by default a random one per job, which the run hands to its
workflow, so agent code never sees it being made), compared in constant time; and a
body is refused at its declared `Content-Length` before any of it is read, or, when
it declares none (chunked) or lies, as soon as what was read passes the cap, so an
oversized request costs the endpoint at most the cap in memory.

Errors are OpenAI error bodies (`APIError`), as the endpoint's other errors are, so
the `openai` client raises its usual classes (AuthenticationError for the 401).

Pure: no Serve; the deployment passes header values and the body's chunks.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import AsyncIterable
from dataclasses import dataclass

from fastapi.security.utils import get_authorization_scheme_param

from areal_ray.rollout.openai.protocol import APIError

# OpenAI's error `type`s for the statuses the endpoint's guards answer with.
KINDS = {401: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class EndpointError(APIError):
    """An APIError whose body names the kind OpenAI uses for its status."""

    def body(self) -> dict:
        body = super().body()
        body["error"]["type"] = KINDS.get(self.status, body["error"]["type"])
        return body


def new_api_key() -> str:
    """A fresh key: 256 random bits, URL-safe (it travels in a header)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class RequestGuard:
    api_key: str
    max_request_bytes: int

    def __post_init__(self):
        if not self.api_key:
            raise ValueError("the endpoint needs an API key (rollout.openai.api_key; the run "
                             "generates one when it is left empty)")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")

    def authorize(self, authorization: str | None) -> None:
        """Raise a 401 unless `authorization` (the header) is `Bearer <the key>`."""
        scheme, given = get_authorization_scheme_param(authorization)
        # compare_digest: the time taken does not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise EndpointError(401, "missing or wrong API key: send the run's rollout.openai.api_key "
                                     "as 'Authorization: Bearer <key>' (the openai client's api_key)")

    def _too_large(self, what: str) -> EndpointError:
        return EndpointError(413, f"the request body is {what}: the endpoint accepts at most "
                                  f"{self.max_request_bytes} bytes (rollout.openai.max_request_bytes)")

    def check_length(self, content_length: str | None) -> None:
        """Refuse a body by its declared length, before reading any of it."""
        if content_length is None:
            return
        try:
            n = int(content_length)
        except ValueError:
            n = -1
        if n < 0:
            raise EndpointError(400, f"Content-Length {content_length!r} is not a byte count")
        if n > self.max_request_bytes:
            raise self._too_large(f"{n} bytes")

    async def read(self, chunks: AsyncIterable[bytes]) -> bytes:
        """The body, read until it passes the cap (then a 413: the rest is never read)."""
        parts, n = [], 0
        async for chunk in chunks:
            n += len(chunk)
            if n > self.max_request_bytes:
                raise self._too_large(f"over {self.max_request_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)
