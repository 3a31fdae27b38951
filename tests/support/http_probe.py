"""Read a process's probe or metrics endpoint as an orchestrator would."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def get(port: int, path: str) -> tuple[int, Any]:
    """``(status, body)`` of ``path`` on 127.0.0.1:``port``: JSON, or text for ``/metrics``.

    ``(0, None)`` while nothing listens yet.
    """
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            body = answer.read()
            return answer.status, json.loads(body) if path != "/metrics" else body.decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return 0, None  # not listening yet
