"""Reading a text file the catalog writes or reads (receipts, specs, profiles): UTF-8, or a clear reason why not."""

from __future__ import annotations


class NotUtf8(ValueError):
    """Bytes that are not UTF-8 text; the message says what they seem to be instead and what to do."""


def utf8_text(raw: bytes) -> str:
    """`raw` as UTF-8 text (a byte-order mark is allowed and dropped). Gzip data, UTF-16 or UTF-32 text and other
    bytes raise NotUtf8: Python's own UnicodeDecodeError names neither the file nor the fix."""
    if raw.startswith(b"\x1f\x8b"):
        raise NotUtf8("gzip-compressed data: decompress it first")
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in raw[:4]:
        raise NotUtf8("UTF-16 or UTF-32 text: save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise NotUtf8(f"not UTF-8 text: byte {exc.start} is {raw[exc.start]:#04x}") from exc
