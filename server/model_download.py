"""One version of the global model as nodes download it, whole or a byte range at a time, with
its SHA-256 (a root serves its own; an edge serves its copy of its root's)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shoal.params import ParamSpec
from shoal.wire import encode_model, model_parts


@dataclass
class ModelDownload:
    """One version of the global model as its node download: the message header ``head``, then the
    parameters' memory ``data`` (server/app.py serves it whole or a byte range at a time)."""

    version: int
    etag: str
    head: bytes
    data: memoryview
    _sha256: str | None = None

    @property
    def size(self) -> int:
        return len(self.head) + len(self.data)

    def pieces(self, start: int, end: int, step: int = 1 << 20) -> Iterator[memoryview]:
        """The bytes ``[start, end)`` as views of at most ``step`` bytes (no copy)."""
        for part, base in ((memoryview(self.head), 0), (self.data, len(self.head))):
            a, b = max(start - base, 0), min(end - base, len(part))
            for x in range(a, b, step):
                yield part[x : min(x + step, b)]

    def sha256(self, start: int = 0, end: int | None = None) -> str:
        """The SHA-256 of bytes ``[start, end)`` (the whole: computed once). Releases the GIL: run it
        in a thread for a large model."""
        whole = start == 0 and end in (None, self.size)
        if whole and self._sha256 is not None:
            return self._sha256
        h = hashlib.sha256()
        for piece in self.pieces(start, self.size if end is None else end, 16 << 20):
            h.update(piece)
        if whole:
            self._sha256 = h.hexdigest()
        return h.hexdigest()


class ServedModel:
    """The global model as nodes get it, made once per version: the encoded message (with the
    algorithm's broadcast beside the model: SCAFFOLD's control variate) and the download of the
    parameters' own memory (no encoded copy) where nothing travels beside the model."""

    def __init__(self, spec: ParamSpec):
        self.spec = spec
        self._body: tuple[int, bytes] | None = None
        self._download: ModelDownload | None = None

    def etag(self, version: int) -> str:
        return f'"{self.spec.hash}-v{version}"'

    def body(self, version: int, params: torch.Tensor, aux: dict[str, torch.Tensor] | None) -> bytes:
        if self._body is None or self._body[0] != version:
            self._body = (version, encode_model(params, self.spec, version, aux=aux))
        return self._body[1]

    def download(self, version: int, params: torch.Tensor, aux: dict[str, torch.Tensor] | None) -> ModelDownload:
        if self._download is None or self._download.version != version:
            if aux:
                head, data = b"", memoryview(self.body(version, params, aux))
            else:
                head, data = model_parts(params, self.spec, version)
            self._download = ModelDownload(version, self.etag(version), head, data)
        return self._download
