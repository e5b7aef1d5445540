"""The server's outer ASGI layer: API keys, a bound on request bodies, and a catch-all that
turns any failure into an OpenAI-shaped 500 (logged once) instead of a bare one."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from axplug_serve.protocol import error_body

__all__ = ["Guard"]

log = logging.getLogger("axplug.serve")


class _TooLarge(BaseException):  # noqa: N818
    """The body grew past the limit while it was read (no Content-Length, or a false one).
    Not an Exception: the framework's body parsing would turn one into a 400."""


class Guard:
    """Wraps an ASGI `app`: with `api_keys`, every path but `open_paths` needs
    `Authorization: Bearer KEY` (401 otherwise); bodies over `max_body_bytes` are refused
    with 413 before they are parsed; an exception the app lets out is a JSON 500."""

    def __init__(
        self,
        app: Any,
        *,
        api_keys: Sequence[str] = (),
        open_paths: Sequence[str] = ("/health", "/metrics"),
        max_body_bytes: int = 8 << 20,
        on_reject: Any = None,
    ):
        self.app, self.api_keys, self.open_paths = app, tuple(api_keys), tuple(open_paths)
        self.max_body_bytes = max_body_bytes
        self._on_reject = on_reject or (lambda status: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_keys and not self._authorized(scope, headers):
            return await self._reply(
                send,
                401,
                "Incorrect API key provided: send it as 'Authorization: Bearer KEY'",
                "invalid_request_error",
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
            )
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(send, int(declared))
        started, seen = False, 0

        async def bounded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._too_large(send, None)
        except Exception as exc:  # noqa: BLE001 -- the client gets a 500, the log the details
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await self._reply(
                    send, 500, f"internal server error ({type(exc).__name__}); the server "
                    "logged the details", "server_error",
                )  # fmt: skip

    def _authorized(self, scope, headers: dict[str, str]) -> bool:
        if scope.get("path") in self.open_paths or scope.get("method") == "OPTIONS":
            return True  # CORS preflights carry no credentials
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = key.strip().encode()
        # Every key compared, in constant time: no early exit tells which one nearly matched.
        matches = [secrets.compare_digest(given, k.encode()) for k in self.api_keys]
        return any(matches)

    async def _too_large(self, send, size: int | None) -> None:
        what = f"{size} bytes" if size is not None else "longer than that"
        await self._reply(
            send, 413, f"the request body is {what}; this server takes at most "
            f"{self.max_body_bytes} bytes (--max-body-bytes)", "invalid_request_error",
        )  # fmt: skip

    async def _reply(self, send, status: int, message: str, kind: str, code=None, headers=()):
        self._on_reject(status)
        body = json.dumps(error_body(message, kind, code=code)).encode()
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), *headers],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": body})
