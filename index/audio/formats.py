"""The audio formats tonearm accepts from users, in one place (docs/service.md, docs/bundle.md).

Uploads (``POST /v1/search/audio``) and ``tonearm index`` accept exactly :data:`FORMATS`:
WAV, FLAC, OGG (Vorbis/Opus) and MP3, recognised from the content's magic bytes (RIFF…WAVE,
fLaC, OggS, ID3 or an MPEG audio frame sync) — never from a file name or a declared media
type. libsndfile reads more (AU, AIFF, …), but what the service refuses, the indexer refuses
too, so a bundle never holds a clip whose file the service would not take as a query.

A file is accepted only when its whole stream decodes: :func:`missing_bytes` finds a WAV cut
short (the RIFF ``data`` chunk declares more bytes than the file holds — libsndfile silently
reads what is there), and :func:`index.audio.decode.decode_audio` with ``complete=True`` compares
the decoded sample count with the count the header declares (FLAC STREAMINFO, the MP3
Xing/Info frame count); truncated Ogg streams fail in libsndfile itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO


@dataclass(frozen=True)
class AudioFormat:
    name: str
    """Short name reported by the service (``format`` of an audio search)."""
    media_type: str
    """The media type the OpenAPI schema lists for raw uploads."""


FORMATS: tuple[AudioFormat, ...] = (
    AudioFormat("wav", "audio/wav"),
    AudioFormat("flac", "audio/flac"),
    AudioFormat("ogg", "audio/ogg"),
    AudioFormat("mp3", "audio/mpeg"),
)
MEDIA_TYPES: tuple[str, ...] = tuple(f.media_type for f in FORMATS)
SUPPORTED = "WAV, FLAC, OGG (Vorbis/Opus) or MP3"
SNIFF_BYTES = 12
"""Leading bytes :func:`sniff_format` needs."""


def _is_mpeg_frame(head: bytes) -> bool:
    """MPEG audio frame header: 11-bit sync, a defined version and layer, a valid bitrate index."""
    if len(head) < 3 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return False
    version, layer, bitrate = (head[1] >> 3) & 0b11, (head[1] >> 1) & 0b11, head[2] >> 4
    return version != 0b01 and layer != 0b00 and bitrate != 0b1111


def sniff_format(head: bytes) -> str | None:
    """Name of the container the leading bytes announce (one of :data:`FORMATS`), else None."""
    if len(head) >= 12 and head[:4] in (b"RIFF", b"RF64") and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3" or _is_mpeg_frame(head[:3]):
        return "mp3"
    return None


def missing_bytes(handle: BinaryIO, size: int) -> int:
    """Bytes a RIFF/WAVE stream's ``data`` chunk declares beyond the end of the stream (0 if complete).

    ``handle`` is positioned anywhere; ``size`` is the stream's length. A ``data`` size of 0
    or 0xFFFFFFFF (streaming writers that never patched the header) and RF64 files (the size
    lives in the ds64 chunk) declare nothing checkable and count as complete.
    """
    handle.seek(0)
    if handle.read(4) != b"RIFF":
        return 0
    position = 12
    while position + 8 <= size:
        handle.seek(position)
        chunk_id, chunk_size = struct.unpack("<4sI", handle.read(8))
        if chunk_id == b"data":
            if chunk_size in (0, 0xFFFFFFFF):
                return 0
            return max(0, chunk_size - (size - position - 8))
        position += 8 + chunk_size + (chunk_size & 1)
    return 0


OGG_END_OF_STREAM = 0x04
"""Header-type flag of the page that closes a logical Ogg stream."""


def ogg_cut_short(handle: BinaryIO, size: int) -> str | None:
    """Why an Ogg stream (Vorbis, Opus) is cut short, or None when it is whole.

    Ogg declares no total length, so libsndfile decodes whatever pages a truncated file still
    holds without an error. A whole file is a chain of pages (``OggS``, 27-byte header, segment
    table, segments) that reaches the end of the file, and every logical stream in it ends with
    a page carrying the end-of-stream flag. Bytes after the last stream has ended (a trailing
    tag) are allowed.
    """
    position, seen = 0, False
    open_streams: set[bytes] = set()
    while position < size:
        handle.seek(position)
        header = handle.read(27)
        if len(header) < 4 or header[:4] != b"OggS":
            if seen and not open_streams:
                return None  # trailing bytes after the last stream ended
            return f"no Ogg page at byte {position} of {size}"
        if len(header) < 27:
            return f"its last page header lacks {27 - len(header)} bytes"
        flags, serial, segments = header[5], header[14:18], header[26]
        table = handle.read(segments)
        end = position + 27 + segments + sum(table)
        if len(table) < segments or end > size:
            return f"its last page lacks {max(end, position + 27 + segments) - size} bytes"
        seen = True
        open_streams.add(serial)
        if flags & OGG_END_OF_STREAM:
            open_streams.discard(serial)
        position = end
    if open_streams or not seen:
        return "its last page does not end the stream (no end-of-stream page)"
    return None
