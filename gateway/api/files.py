"""/v1/files: upload (streamed to the volume), list, retrieve, download, delete (the work is in files/)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from gateway import idempotency
from gateway.auth import owner
from gateway.errors import APIError, invalid
from gateway.files.upload import receive_upload
from gateway.http import get_ctx

router = APIRouter()


@router.post("/v1/files")
async def create_file(request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    ctx = get_ctx(request)
    client_key = idempotency.header_key(request)
    meta = await receive_upload(request, ctx.files, who)
    if client_key is None:
        return meta.to_openai()

    def replay() -> dict[str, Any]:
        # The file is stored before its key is claimed (the digest needs every byte): a replay drops the copy.
        try:
            earlier = idempotency.claim(ctx.redis, ctx.gkeys, "files", who, client_key, meta._digest, meta.id).earlier
        except BaseException:
            ctx.files.remove(meta.id, who)
            raise
        if earlier is None:
            return meta.to_openai()
        ctx.files.remove(meta.id, who)
        return ctx.files.get(who, earlier).to_openai()

    return await run_in_threadpool(replay)


@router.get("/v1/files")
async def list_files(request: Request, who: str = Depends(owner), limit: int = Query(100, ge=1, le=10_000),
                     after: str | None = None) -> dict[str, Any]:
    ctx = get_ctx(request)

    def page() -> dict[str, Any]:
        key = ctx.gkeys.files(who)
        start = 0
        if after:
            rank = ctx.redis.zrevrank(key, after)
            if rank is None:
                raise invalid(f"after: no file {after!r} in your list", param="after")
            start = rank + 1
        ids = ctx.redis.zrevrange(key, start, start + limit)
        data = []
        for fid in ids[:limit]:
            if meta := ctx.files.find(who, fid):  # None: deleted since the ZREVRANGE
                data.append(meta.to_openai())
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit}

    return await run_in_threadpool(page)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    meta = await run_in_threadpool(get_ctx(request).files.get, who, file_id)
    return meta.to_openai()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request, who: str = Depends(owner)) -> FileResponse:
    ctx = get_ctx(request)
    meta = await run_in_threadpool(ctx.files.get, who, file_id)
    path = ctx.files.path(meta.id)
    if not path.is_file():
        raise APIError(500, f"the content of {meta.id} is missing from this gateway's files_dir; every gateway "
                            "and tasks process must mount the same directory (TOKENBUS_GATEWAY_FILES_DIR)",
                       code="file_content_missing")
    # FileResponse sends the file in chunks: a big output file never sits in memory.
    return FileResponse(path, media_type="application/jsonl", filename=meta.filename,
                        content_disposition_type="attachment")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, who: str = Depends(owner)) -> dict[str, Any]:
    await run_in_threadpool(get_ctx(request).files.delete, who, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
