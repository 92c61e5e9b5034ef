"""uvicorn's h11 protocol, with its protocol-level errors in OpenAI's JSON shape.

A request that never reaches the app (headers over the limit, a malformed request line) would get
uvicorn's plain-text 400; clients parsing `{"error": ...}` then fail on the body instead of the status.
Oversized headers get 431 (Request Header Fields Too Large), anything else 400.
"""

from __future__ import annotations

import json
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from titan.server.errors import error_body
from titan.server.limits import DEFAULT_MAX_HEADER_BYTES


class JSONErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEADER_BYTES
        # h11 refuses to buffer an incomplete head beyond the limit: that is the oversized-headers case.
        buffered = len(getattr(self.conn, "_receive_buffer", b""))
        if buffered >= limit:
            status, code = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request_header_fields_too_large"
            message = f"The request headers are larger than the limit of {limit} bytes."
        else:
            status, code, message = HTTPStatus.BAD_REQUEST, "invalid_http_request", "Invalid HTTP request received."
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=int(status), headers=headers,
                                                         reason=status.phrase.encode())))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()
