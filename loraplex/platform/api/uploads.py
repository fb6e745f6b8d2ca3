"""Reading adapter uploads from multipart requests (shared by the admin and tenant routes).

The form has a text field ``name`` and either ``file`` (one .zip / .tar.gz) or
``files`` (the two PEFT files). The declared ``Content-Length`` is checked
before the body is parsed; ``guards.RequestGuard`` stops bodies without one.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.datastructures import FormData, UploadFile

from loraplex.platform.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from loraplex.platform.services.uploads import UploadPart

MULTIPART_OVERHEAD_BYTES = 64 * 1024

UPLOAD_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
                "file": {"type": "string", "format": "binary", "description": "One .zip or .tar.gz archive."},
                "files": {"type": "array", "items": {"type": "string", "format": "binary"},
                          "description": "adapter_config.json and adapter_model.safetensors."},
            },
        }}},
    }
}


async def read_upload(request: Request, max_bytes: int) -> tuple[str, list[UploadPart], FormData]:
    """Parse the upload form; returns (name, parts, form). Close ``form`` when done.

    Raises ``UnsupportedMediaType`` (not multipart), ``PayloadTooLarge`` (declared body
    over ``max_bytes``), ``InvalidRequest`` (missing/extra fields).
    """
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise UnsupportedMediaType(f"content type {content_type.split(';')[0]!r}: uploads must be "
                                   "multipart/form-data", param="file")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes + MULTIPART_OVERHEAD_BYTES:
        raise PayloadTooLarge(f"upload is {declared} bytes; the limit is {max_bytes} bytes", param="file")
    try:
        form = await request.form(max_files=4, max_fields=8)
    except PayloadTooLarge:
        raise
    except Exception as exc:  # malformed multipart bodies
        raise InvalidRequest(f"malformed multipart body ({exc})", param="file") from None
    name = form.get("name")
    if not isinstance(name, str) or not name:
        await form.close()
        raise InvalidRequest("form field `name` is required", param="name")
    uploads = [f for f in form.getlist("file") + form.getlist("files") if isinstance(f, UploadFile)]
    if not uploads:
        await form.close()
        raise InvalidRequest("send one archive in `file` or the two PEFT files in `files`", param="file")
    if form.getlist("file") and form.getlist("files"):
        await form.close()
        raise InvalidRequest("send either `file` or `files`, not both", param="file")
    parts = [UploadPart(filename=u.filename or "", content_type=u.content_type, fileobj=u.file,
                        size_bytes=_size(u)) for u in uploads]
    return name, parts, form


def _size(upload: UploadFile) -> int:
    if upload.size is not None:
        return upload.size
    upload.file.seek(0, 2)
    size = upload.file.tell()
    upload.file.seek(0)
    return size

