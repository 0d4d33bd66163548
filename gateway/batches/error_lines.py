"""Batch output lines in OpenAI's shapes, made from `tokenbus batch export` lines at finalisation.

OpenAI's error file has two kinds of line. A request that ran and failed carries the HTTP answer it would
have got: `response: {status_code, request_id, body: {error: {message, type, param, code}}}, error: null`.
A request that never ran (the batch was cancelled or expired first) carries `response: null,
error: {code: batch_cancelled | batch_expired, message}`. The output file has the 200 responses.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.jobs import error_for

NEVER_RAN = {"cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
             "expired": ("batch_expired", "This request could not be executed before the completion window "
                                          "expired.")}


def openai_line(line: dict[str, Any], *, expired: bool) -> tuple[str, bytes]:
    """("output" | "error", the line as JSONL bytes)."""
    error = line.get("error")
    if error is None:
        kind = "output"
    else:
        kind, code = "error", error.get("code")
        if code == "expired":
            pass  # the job's record outlived result_ttl: no answer is known, the line stays as exported
        elif code == "cancelled":
            # An expiry cancels what is left, so those jobs say "cancelled": OpenAI calls them batch_expired.
            new_code, message = NEVER_RAN["expired" if expired else "cancelled"]
            line = line | {"response": None, "error": {"code": new_code, "message": message}}
        else:
            api = error_for(code, error.get("message") or "")
            request_id = str(line.get("id", "")).removeprefix("batch_req_")
            line = line | {"response": {"status_code": api.status, "request_id": request_id, "body": api.body()},
                           "error": None}
    return kind, (json.dumps(line, ensure_ascii=False) + "\n").encode()
