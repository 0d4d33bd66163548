"""Every error the gateway answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

import redis
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from protocol.errors import ModelNotFound, QueueFull

log = structlog.get_logger("tokenbus.gateway")

# OpenAI's `type` values by status; `code` says more where a client may branch on it.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 504: "server_error"}


class APIError(Exception):
    """An error answered to the client: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str) -> APIError:
    # The same answer whether the object never existed or belongs to another key: ids leak nothing.
    return APIError(404, f"No {kind} found with id '{object_id}'.", param="id", code=f"{kind}_not_found")


def model_not_found(err: ModelNotFound) -> APIError:
    """OpenAI's answer to an unknown model (404 `model_not_found`), listing the models this gateway serves."""
    return APIError(404, f"The model '{err.model}' does not exist or you do not have access to it. Models: "
                         f"{', '.join(err.declared) or 'none declared yet'} (GET /v1/models).",
                    param="model", code="model_not_found")


def too_large(limit: int, what: str) -> APIError:
    return APIError(413, f"{what} is larger than this gateway's limit of {limit} bytes; split it into smaller "
                         f"parts or ask the operator to raise the limit", code="request_too_large")


def redis_error(err: redis.RedisError) -> APIError:
    """What a Redis failure means to the client: Redis full (its maxmemory reached: writes refused until work
    ends or the operator makes room) is not Redis unreachable, and neither is a command Redis refused."""
    if isinstance(err, redis.exceptions.OutOfMemoryError):
        return APIError(503, "the gateway's Redis is full (it reached its maxmemory and refuses writes); retry "
                             "when running work has ended. Operators: raise Redis's maxmemory or lower the "
                             "gateway's byte limits (docs/gateway.md)", code="redis_full",
                        headers={"retry-after": "30"})
    if isinstance(err, redis.ConnectionError | redis.TimeoutError):
        return APIError(503, "the gateway cannot reach its Redis right now; retry shortly",
                        code="redis_unavailable", headers={"retry-after": "5"})
    return APIError(503, f"the gateway's Redis refused a command ({type(err).__name__}); retry shortly, and "
                         "report it if it persists", code="redis_error", headers={"retry-after": "5"})


def install(app: FastAPI) -> None:
    """Answer every failure, ours or the framework's, in the one shape OpenAI clients parse."""

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, err: HTTPException) -> JSONResponse:
        message = {404: "Unknown URL: see docs/gateway.md for the endpoints",
                   405: "Method not allowed for this URL"}.get(err.status_code, str(err.detail))
        return APIError(err.status_code, message, headers=getattr(err, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")]
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in err.errors())
        return invalid(message or "invalid request", param=".".join(loc) or None).response()

    @app.exception_handler(ModelNotFound)
    async def _model_not_found(_req: Request, err: ModelNotFound) -> JSONResponse:
        return model_not_found(err).response()

    @app.exception_handler(QueueFull)
    async def _queue_full(_req: Request, err: QueueFull) -> JSONResponse:
        return APIError(429, str(err), code="queue_full", headers={"retry-after": "10"}).response()

    @app.exception_handler(redis.RedisError)
    async def _redis(_req: Request, err: redis.RedisError) -> JSONResponse:
        log.error("redis_error", error=str(err), kind=type(err).__name__)
        return redis_error(err).response()

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected_error", error=repr(err))
        return APIError(500, "internal error in the gateway (logged); retry, and report it if it persists",
                        code="internal_error").response()
