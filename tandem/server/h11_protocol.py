"""uvicorn's h11 protocol, answering requests h11 cannot parse in OpenAI's error JSON.

h11 refuses a header block larger than its limit (and malformed HTTP) before any ASGI code runs;
uvicorn then sends a plain-text 400. Clients of an OpenAI-compatible server parse error JSON, and
an oversized header block is a 431, so this subclass sends `{"error": {...}}` with the right status.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.server import errors


class TandemH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:  # uvicorn calls it when h11 raises RemoteProtocolError
        buffered, _ = self.conn.trailing_data
        limit = self.config.h11_max_incomplete_event_size
        if limit is not None and len(buffered) > limit:
            err = errors.headers_too_large(limit)
        else:
            err = errors.bad_request(f"Invalid HTTP request: {msg}")
        body = json.dumps(err.to_dict()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=err.status, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # the connection is past answering (e.g. a response already began)
            pass
        self.transport.close()
