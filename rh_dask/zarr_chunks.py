"""Whole Zarr chunks decoded straight into a stream's batches.

:func:`rh_dask.read_zarr` cuts a stream into the store's chunks along rows,
so each batch is whole chunks. zarr's indexing reads a chunk, decodes it
into a buffer of its own and copies the selection out, through its
asynchronous machinery; for a whole chunk it is cheaper to read the chunk's
bytes and decode them once, into the batch itself. Measured on the dev box
(one core, zarr 3.1.6, 262,144 × 90 float32 chunks, zstd, page cache warm,
median of 12): 103 ms a chunk this way against 144 ms through zarr's
indexing (docs/performance.md, "Scale-out").

This applies to arrays whose chunk bytes are the array's own values:
chunked along rows only, a regular grid, native byte order, C order, no
filters, no sharding, and one compressor that numcodecs decodes (or none).
Anything else, and any selection that is not one whole chunk of rows, goes
through zarr itself, as does a chunk that was never written (zarr fills it).
Decoding is numcodecs', the library zarr decodes with.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .exceptions import InputError

__all__ = ["ZarrRows", "direct_rows"]


@dataclass(frozen=True)
class _KeyFormat:
    """How a chunk's grid coordinates name its object in the store."""

    prefix: str  # "c" for zarr v3's default encoding, "" otherwise
    separator: str

    def key(self, coords: tuple[int, ...]) -> str:
        parts = [self.prefix] if self.prefix else []
        parts += [str(c) for c in coords]
        return self.separator.join(parts) if parts else "0"


def _key_format(metadata: Any, ndim: int) -> _KeyFormat | None:
    """The array's chunk key format, checked against zarr's own encoding."""
    encode = getattr(metadata, "encode_chunk_key", None)
    if encode is None:
        return None
    probes = [tuple([0] * ndim), tuple([1] + [0] * (ndim - 1)), tuple([12] + [0] * (ndim - 1))]
    for prefix in ("c", ""):
        for separator in ("/", "."):
            fmt = _KeyFormat(prefix, separator)
            if all(fmt.key(c) == encode(c) for c in probes):
                return fmt
    return None


def _native(dtype: np.dtype) -> bool:
    return dtype.byteorder in ("=", "|") or dtype.byteorder == (
        "<" if sys.byteorder == "little" else ">"
    )


def _v3_codec(codecs: tuple[Any, ...]) -> dict[str, Any] | bool | None:
    """The numcodecs config that decodes a v3 codec chain, ``None`` for raw bytes, False: no."""
    if not codecs or type(codecs[0]).__name__ != "BytesCodec":
        return False
    endian = getattr(codecs[0], "endian", None)
    if endian is not None and getattr(endian, "value", endian) != sys.byteorder:
        return False
    rest = codecs[1:]
    if not rest:
        return None
    if len(rest) > 1:
        return False
    name = type(rest[0]).__name__
    if name == "ZstdCodec":
        return {"id": "zstd", "level": int(rest[0].level)}
    if name == "BloscCodec":
        return {"id": "blosc"}  # its frames carry their own parameters
    if name == "GzipCodec":
        return {"id": "gzip", "level": int(rest[0].level)}
    return False


def _v2_codec(metadata: Any) -> dict[str, Any] | bool | None:
    if getattr(metadata, "filters", None) or getattr(metadata, "order", "C") != "C":
        return False
    compressor = getattr(metadata, "compressor", None)
    if compressor is None:
        return None
    get_config = getattr(compressor, "get_config", None)
    return dict(get_config()) if callable(get_config) else False


@dataclass(frozen=True)
class ZarrRows:
    """One Zarr array as an array-like whose whole chunks of rows decode directly.

    Made by :func:`direct_rows`; what :func:`dask.array.from_array` reads a
    stream's blocks from. Small and picklable: each loading process opens
    what it needs once.

    Attributes
    ----------
    store : str
        The store's path or fsspec URL.
    component : str or None
        The array's path inside the store (``None``: the store is the array).
    storage_options : str
        The fsspec options, as JSON (hashable).
    shape, chunks : tuple of int
        The array's shape and chunk shape (only the first axis is chunked).
    dtype : str
        The array's dtype (native byte order).
    codec : str
        The numcodecs configuration that decodes a chunk, as JSON (``"null"``:
        the chunk is the raw bytes).
    keys : _KeyFormat
        How chunk coordinates name their objects.
    """

    store: str
    component: str | None
    storage_options: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    codec: str
    keys: _KeyFormat

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __dask_tokenize__(self) -> Any:
        return ("rh-dask-zarr-rows", dataclasses.astuple(self))

    def _whole_chunk(self, index: Any) -> int | None:
        """The chunk row index when ``index`` selects exactly one whole chunk of rows."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > self.ndim or not all(isinstance(s, slice) for s in index):
            return None
        index += (slice(None),) * (self.ndim - len(index))
        rows = index[0].indices(self.shape[0])
        if rows[2] != 1 or rows[0] % self.chunks[0]:
            return None
        if rows[1] != min(rows[0] + self.chunks[0], self.shape[0]):
            return None
        for s, n in zip(index[1:], self.shape[1:], strict=True):
            if s.indices(n) != (0, n, 1):
                return None
        return rows[0] // self.chunks[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        chunk = self._whole_chunk(index)
        if chunk is not None:
            decoded = self._decode(chunk)
            if decoded is not None:
                return decoded
        return np.asarray(_opened(self.store, self.component, self.storage_options)[index])

    def _decode(self, chunk: int) -> np.ndarray | None:
        """Chunk ``chunk`` decoded into a new array; ``None`` when it was never written."""
        fs, root = _filesystem(self.store, self.storage_options)
        key = self.keys.key((chunk,) + (0,) * (self.ndim - 1))
        parts = [root.rstrip("/")] + ([self.component.strip("/")] if self.component else [])
        path = "/".join([*parts, key])
        try:
            raw = fs.cat_file(path)
        except FileNotFoundError:
            return None  # zarr fills it with the array's fill value
        out = np.empty(self.chunks, dtype=self.dtype)
        try:
            codec = _codec(self.codec)
            # numcodecs decodes a frame shorter than ``out`` without a word and
            # leaves the rest as it was: the frame's own size is checked first.
            size = len(raw) if codec is None else declared_size(codec.codec_id, raw)
            if size is None:
                return None  # a frame that does not declare its size: zarr's indexing
            if size != (out.nbytes % 2**32 if codec and codec.codec_id == "gzip" else out.nbytes):
                raise ValueError(f"it holds {size} bytes where the chunk has {out.nbytes}")
            if codec is None:
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)
            else:
                codec.decode(raw, out=out)
        except Exception as exc:  # numcodecs raises several types for a corrupt frame
            raise InputError(
                f"{path}: chunk {key} of the Zarr array could not be decoded: {exc}", path=path
            ) from exc
        rows = min(self.chunks[0], self.shape[0] - chunk * self.chunks[0])
        return out if rows == self.chunks[0] else out[:rows]


_ZSTD_MAGIC = 0xFD2FB528


def declared_size(codec_id: str, frame: bytes) -> int | None:
    """The decoded size a compressed chunk declares, ``None`` where it does not.

    zstd: the first frame's Frame_Content_Size (RFC 8878, 3.1.1); blosc: the
    header's uncompressed size; gzip: ISIZE, the size modulo 2³² (RFC 1952).

    Raises
    ------
    ValueError
        When the frame is too short for its header (not a frame of that codec).
    """
    if codec_id == "zstd":
        if len(frame) < 6 or int.from_bytes(frame[:4], "little") != _ZSTD_MAGIC:
            raise ValueError("not a zstd frame")
        descriptor = frame[4]
        single = (descriptor >> 5) & 1
        start = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3]
        width = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
        if width == 0:
            return None
        if len(frame) < start + width:
            raise ValueError("a zstd frame header cut short")
        value = int.from_bytes(frame[start : start + width], "little")
        return value + 256 if width == 2 else value
    if codec_id == "blosc":  # the 16-byte header: version, versionlz, flags, typesize, nbytes
        if len(frame) < 16:
            raise ValueError("not a blosc frame")
        return int.from_bytes(frame[4:8], "little")
    if codec_id == "gzip":
        if len(frame) < 18:
            raise ValueError("not a gzip member")
        return int.from_bytes(frame[-4:], "little")
    return None


@functools.lru_cache(maxsize=64)
def _filesystem(store: str, storage_options: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(store, **json.loads(storage_options))


@functools.lru_cache(maxsize=64)
def _opened(store: str, component: str | None, storage_options: str) -> Any:
    import zarr

    options = json.loads(storage_options)
    kwargs = {"storage_options": options} if options else {}
    if component:
        kwargs["path"] = component
    return zarr.open_array(store=store, mode="r", **kwargs)


@functools.lru_cache(maxsize=64)
def _codec(config: str) -> Any:
    import numcodecs

    found = json.loads(config)
    return None if found is None else numcodecs.get_codec(found)


def direct_rows(
    array: Any, store: str, component: str | None, storage_options: dict[str, Any] | None
) -> ZarrRows | None:
    """A :class:`ZarrRows` for ``array`` (an open ``zarr.Array``), or ``None`` where it cannot.

    ``None`` (zarr's own indexing then reads every chunk) for arrays chunked
    along more than the rows, of a non-native byte order, with filters,
    sharding or codecs numcodecs does not decode, for storage options that
    are not plain JSON values, and for zarr before 3.
    """
    metadata = getattr(array, "metadata", None)
    if metadata is None or not hasattr(metadata, "zarr_format"):
        return None
    shape, chunks = tuple(array.shape), tuple(array.chunks)
    dtype = np.dtype(array.dtype)
    if not shape or shape[1:] != chunks[1:] or not _native(dtype) or dtype.hasobject:
        return None
    if getattr(array, "shards", None) is not None:
        return None
    if metadata.zarr_format == 3:
        if type(getattr(metadata, "chunk_grid", None)).__name__ != "RegularChunkGrid":
            return None
        codec = _v3_codec(tuple(metadata.codecs))
    else:
        codec = _v2_codec(metadata)
    if codec is False:
        return None
    keys = _key_format(metadata, len(shape))
    if keys is None:
        return None
    try:
        options = json.dumps(storage_options or {}, sort_keys=True)
    except (TypeError, ValueError):
        return None  # options that are objects (credentials, sessions): zarr's indexing
    return ZarrRows(
        store=store,
        component=component,
        storage_options=options,
        shape=shape,
        chunks=chunks,
        dtype=dtype.str,
        codec=json.dumps(codec, sort_keys=True),
        keys=keys,
    )
