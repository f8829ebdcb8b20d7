"""What the tests' fake HTTP servers (the Kubernetes API, Airflow's REST API) share."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


def send_json(handler: BaseHTTPRequestHandler, code: int, body: dict) -> None:
    """Answer the request with `body` as JSON, with its length (the clients keep the connection alive)."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
