"""POST /v1/files body: multipart/form-data parsed as it arrives, the file part written straight to the volume.

Starlette's request.form() would spool the file to a temporary file first and hand it over only at the end;
here each received chunk goes to the destination (and through the line validator) at once, so an upload of
any size needs one chunk of memory and one pass over the disk.
"""

from __future__ import annotations

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from gateway.errors import invalid
from gateway.files.store import PURPOSES_UPLOADED, FileMeta, FileStore, Upload

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 20


class _Form:
    """python-multipart callbacks: small fields into a dict, the one file part's data into a list."""

    def __init__(self, store: FileStore, owner: str) -> None:
        self.store, self.owner = store, owner
        self.fields: dict[str, str] = {}
        self.upload: Upload | None = None
        self.filename = ""
        self.pending: list[bytes] = []  # file data parsed from the last chunk, not yet written
        self._name = b""
        self._value = b""
        self._headers: dict[bytes, bytes] = {}
        self._field: str | None = None
        self._is_file = False
        self._data = bytearray()

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_done, "on_part_data": self._part_data,
                "on_part_end": self._part_end}

    def _begin(self) -> None:
        self._headers, self._field, self._is_file, self._data = {}, None, False, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._name.lower()] = self._value
        self._name, self._value = b"", b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise invalid("a multipart part has no name in its Content-Disposition header", param="file")
        self._field = options[b"name"].decode("utf-8", "replace")
        if self._field == "file":
            if self.upload is not None:
                raise invalid("send one file per upload (the form has two `file` parts)", param="file")
            self._is_file = True
            self.filename = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")[:255]
            self.upload = self.store.open_upload(self.owner)
        elif len(self.fields) >= MAX_FIELDS:
            raise invalid(f"too many form fields (more than {MAX_FIELDS}); send purpose and file")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.pending.append(data[start:end])
            return
        self._data.extend(data[start:end])
        if len(self._data) > MAX_FIELD_BYTES:
            raise invalid(f"form field {self._field!r} is longer than {MAX_FIELD_BYTES} bytes; only `file` may "
                          "be large", param=self._field)

    def _part_end(self) -> None:
        if not self._is_file and self._field is not None:
            self.fields[self._field] = self._data.decode("utf-8", "replace")


async def receive_upload(request: Request, store: FileStore, owner: str) -> FileMeta:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise invalid("upload a file as multipart/form-data with the fields `purpose` (\"batch\") and `file`",
                      param="file")
    form = _Form(store, owner)
    parser = MultipartParser(params[b"boundary"], form.callbacks())
    try:
        async for chunk in request.stream():
            try:
                parser.write(chunk)
            except MultipartParseError as err:
                raise invalid(f"the multipart body is malformed ({err}); let your HTTP client build it",
                              param="file") from None
            if form.pending:
                data, form.pending = b"".join(form.pending), []
                await run_in_threadpool(form.upload.write, data)
        parser.finalize()
        purpose = form.fields.get("purpose")
        if form.upload is None:
            raise invalid("the form has no `file` part; send the JSONL file as the field `file`", param="file")
        if purpose not in PURPOSES_UPLOADED:
            raise invalid(f"purpose must be one of {', '.join(PURPOSES_UPLOADED)} (got {purpose!r}); this "
                          "gateway stores OpenAI Batch input files", param="purpose")
        return await run_in_threadpool(form.upload.commit, form.filename, purpose)
    except BaseException:
        if form.upload is not None:
            form.upload.abort()
        raise
