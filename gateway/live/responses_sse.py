"""POST /v1/responses with stream: true: the Responses API's typed events (response.created, ...in_progress,
output_item.added, content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done, response.completed / response.incomplete / response.failed), each numbered, made from the
job's token stream by live/sse.py's job_events."""

from __future__ import annotations

import json
import time
from typing import Any

from producer.openai_responses import response_object
from protocol.models import Job


class ResponsesShape:
    def __init__(self, job_id: str, model: str | None, request: dict[str, Any]) -> None:
        self.job_id, self.seq, self.text = job_id, 0, ""
        self.item_id = f"msg_{job_id}"
        self.pending = {"id": f"resp_{job_id}", "object": "response", "created_at": int(time.time()),
                        "status": "in_progress", "error": None, "incomplete_details": None, "output": [],
                        "model": model or "tokenbus", "metadata": request.get("metadata") or {}, "usage": None,
                        "tools": [], "tool_choice": "none", "parallel_tool_calls": False}

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq} | fields
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def opening(self) -> list[str]:
        item = {"type": "message", "id": self.item_id, "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.created", response=self.pending),
                self._event("response.in_progress", response=self.pending),
                self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", **self._where(),
                            part={"type": "output_text", "text": "", "annotations": []})]

    def delta(self, text: str) -> str:
        self.text += text
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def error(self, body: dict[str, Any]) -> str:
        err = body.get("error", {})
        failed = self.pending | {"status": "failed", "error": {"code": err.get("code") or "server_error",
                                                               "message": err.get("message", "")}}
        return self._event("response.failed", response=failed)

    def closing(self, job: Job) -> list[str]:
        final = response_object(job)
        item = final["output"][0]
        part = item["content"][0]
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [self._event("response.output_text.done", **self._where(), text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=part),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event(kind, response=final)]

    def end(self) -> list[str]:
        return []  # the Responses stream ends with its terminal event: no [DONE]
