"""The grammar of catalogue ids (added items and bundle clips), enforced by the API (docs/service.md, "Ids").

An id is 1–:data:`MAX_ID_CHARS` characters and at most :data:`MAX_ID_BYTES` bytes of UTF-8 (every
store takes it: Milvus's VARCHAR primary keys hold 512 bytes, and 256 CJK characters are 768) of
valid Unicode, compared code point by code point, and one or more ``/``-separated segments (``tonearm index`` names a clip in a subfolder by its relative
path, ``birds/owl.wav``; the routes take ``{id:path}``). Refused everywhere:

* control characters (category Cc), format characters (Cf: the bidi overrides and isolates
  U+202A–U+202E and U+2066–U+2069, zero-width characters, U+FEFF…) and lone surrogates (Cs):
  invisible, or able to make one id display as another;
* line and paragraph separators (U+2028, U+2029) and noncharacters (U+FDD0–U+FDEF, U+xFFFE, U+xFFFF):
  they break lines in logs and tables, or are not meant for interchange;
* the invisible fillers that are letters or symbols by category (:data:`INVISIBLE_FILLERS`: the
  Hangul fillers U+115F, U+1160, U+3164, U+FFA0 and the blank Braille pattern U+2800): an id of
  them looks blank, and beside visible characters they make look-alikes;
* an id that is only whitespace, and a segment that begins or ends with whitespace (``"a "`` and
  ``"a"`` would look like one id);
* an empty segment (a leading or trailing ``/``, or ``//``) and a ``.`` or ``..`` segment: clients
  and proxies normalise such paths before they are sent (``curl …/v1/items/x/../val-02401``
  deletes ``val-02401``), so an id holding one could not be addressed as itself.

Ids are normalised to Unicode normalization form C (NFC) at the API: a new id is stored in NFC
(``e`` + U+0301 becomes ``é``, and the response carries the stored id), so two ids that look the
same can never be two items. A route that *addresses* an id (``GET``/``DELETE /v1/items/{id}``,
``GET /v1/search/similar/{id}``) looks it up as sent and, when no item has that exact id, as its
NFC form: a bundle clip's id is its file's path, which some file systems store decomposed
(macOS), and it stays addressable (e.g. to take it down).
"""

from __future__ import annotations

import functools
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence

from index.errors import BundleError, DataError

MAX_ID_CHARS = 256
MAX_ID_BYTES = 512
"""UTF-8 bytes of an id, at most: the VARCHAR length of the Milvus collections' primary keys."""
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Unicode general categories no id may hold: control, format (bidi and zero-width), surrogate, and
the line and paragraph separators."""
INVISIBLE_FILLERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
"""Characters that render as blank space but are letters (Lo) or symbols (So) by category."""


def is_noncharacter(char: str) -> bool:
    """Unicode's 66 noncharacters: U+FDD0–U+FDEF and the last two code points of every plane."""
    code = ord(char)
    return 0xFDD0 <= code <= 0xFDEF or (code & 0xFFFE) == 0xFFFE


class ItemIdError(DataError):
    """An id outside the grammar (its message says which rule, never echoing invisible characters)."""


def check_id(item_id: object, *, new: bool = False) -> str:
    """``item_id`` when it follows the grammar — in NFC when ``new`` (a new id is normalised, and
    refused if its NFC form breaks a rule); :class:`ItemIdError` otherwise."""
    if not isinstance(item_id, str):
        raise ItemIdError("an id must be a string")
    if not 1 <= len(item_id) <= MAX_ID_CHARS:
        raise ItemIdError(f"an id is 1–{MAX_ID_CHARS} characters; this one has {len(item_id)}")
    for position, char in enumerate(item_id):
        category = unicodedata.category(char)
        if category in REFUSED_CATEGORIES:
            kind = {"Cc": "a control character", "Cf": "a format (bidi or invisible) character",
                    "Cs": "a lone surrogate (not valid Unicode)", "Zl": "a line separator",
                    "Zp": "a paragraph separator"}[category]
            raise ItemIdError(f"an id may not hold {kind}: U+{ord(char):04X} at position {position}")
        if char in INVISIBLE_FILLERS:
            raise ItemIdError(f"an id may not hold an invisible filler: U+{ord(char):04X} at position {position}")
        if is_noncharacter(char):
            raise ItemIdError(f"an id may not hold a noncharacter: U+{ord(char):04X} at position {position}")
    if not item_id.strip():
        raise ItemIdError("an id may not be only whitespace")
    size = len(item_id.encode("utf-8"))
    if size > MAX_ID_BYTES:
        raise ItemIdError(f"an id is at most {MAX_ID_BYTES} bytes of UTF-8; this one has {size}")
    for segment in item_id.split("/"):
        if segment in ("", ".", ".."):
            what = "an empty segment (a leading, trailing or double '/')" if not segment else f"a {segment!r} segment"
            raise ItemIdError(f"an id may not hold {what}: clients normalise such paths away")
        if segment != segment.strip():
            raise ItemIdError("an id's segments may not begin or end with whitespace (it would look like another id)")
    if new and not unicodedata.is_normalized("NFC", item_id):
        return check_id(unicodedata.normalize("NFC", item_id), new=False)
    return item_id


def nfc(item_id: str) -> str:
    """The NFC form of an id (what a new id is stored as)."""
    return unicodedata.normalize("NFC", item_id)


@functools.cache
def json_pattern() -> str:
    """The grammar as a JSON Schema ``pattern`` (published in the OpenAPI schema; NFC and the length are
    not regular-expression matters: ``maxLength`` states the length, NFC is applied, not required).
    Refused characters are listed as ranges: BMP ones as ``\\uXXXX`` escapes, astral ones literally."""
    def ranges(keep: Callable[[str], bool]) -> str:
        spans: list[tuple[int, int]] = []
        for code in range(sys.maxunicode + 1):
            if 0xD800 <= code <= 0xDFFF:  # surrogates: no JSON text or URL of valid UTF-8 holds one
                continue
            if keep(chr(code)):
                if spans and spans[-1][1] == code - 1:
                    spans[-1] = (spans[-1][0], code)
                else:
                    spans.append((code, code))
        return "".join(char(a) if a == b else f"{char(a)}-{char(b)}" for a, b in spans)

    def char(code: int) -> str:
        return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)

    refused = ranges(lambda c: unicodedata.category(c) in REFUSED_CATEGORIES or c in INVISIBLE_FILLERS
                     or is_noncharacter(c))
    space = ranges(str.isspace)  # spelled out: `\\s` means other sets in other regex engines
    # no segment empty, '.', '..', or beginning or ending with whitespace (an id only of whitespace included)
    return (f"^(?!(?:.*/)?\\.{{0,2}}(?:/|$))(?!(?:.*/)?[{space}])(?!.*[{space}](?:/|$))[^{refused}]+$")


def catalogue_id_problems(ids: Iterable[str], *, most: int = 5) -> list[str]:
    """The first ``most`` bundle clip ids that no store or route could take, each with why: outside
    the grammar, not in NFC (its look-alike could be created as a second item beside it), or a
    duplicate once normalised."""
    problems: list[str] = []
    seen: set[str] = set()
    for clip_id in ids:
        try:
            check_id(clip_id)
            if not unicodedata.is_normalized("NFC", clip_id):
                raise ItemIdError("not in Unicode NFC (store ids composed: the API stores every new id in NFC)")
            if clip_id in seen:
                raise ItemIdError("a duplicate id")
            seen.add(clip_id)
        except ItemIdError as err:
            problems.append(f"{ascii(clip_id)[:80]}: {err}")
            if len(problems) >= most:
                break
    return problems


def check_catalogue_ids(ids: Iterable[str], where: str) -> None:
    """:class:`BundleError` naming the first offending clip ids of ``where`` (a bundle being published,
    or published to Milvus): every clip id must be one the API and every store accept."""
    problems = catalogue_id_problems(ids)
    if problems:
        raise BundleError(f"{where}: clip ids outside the id grammar (docs/service.md, \"Ids\"): "
                          + "; ".join(problems) + " — rename those clips (or their files) and rebuild")


def shown_id(item_id: str) -> str:
    """``item_id`` as it may be shown (a log line, a manifest's ``skipped_clips``): every character the grammar
    refuses as invisible or invalid (control, format, separator, surrogate, noncharacter, invisible filler)
    written as a ``\\uXXXX`` escape, never raw; everything else as it is."""
    def show(char: str) -> str:  # a backslash doubled too: an escape shown is never one the name held
        if (char == "\\" or unicodedata.category(char) in REFUSED_CATEGORIES or char in INVISIBLE_FILLERS
                or is_noncharacter(char)):
            return char.encode("unicode_escape").decode("ascii")
        return char

    return "".join(map(show, item_id))


def catalogue_ids(ids: Sequence[str]) -> tuple[dict[int, str], dict[int, tuple[str, str]]]:
    """The grammar applied to a catalogue's clip ids before it is embedded (`tonearm export`, `export --pretrained`,
    `tonearm index`): ``(kept, skipped)``, both keyed by position in ``ids``. ``kept``: the id as the bundle
    stores it, in NFC (:func:`check_id` with ``new``); ``skipped``: ``(id as shown, reason)`` of each id the
    grammar refuses (the reason names the rule; :func:`shown_id`) and of each id equal to an earlier one once
    in NFC (the first is kept) — the manifest's ``skipped_clips``."""
    kept: dict[int, str] = {}
    skipped: dict[int, tuple[str, str]] = {}
    first: dict[str, str] = {}
    for position, clip_id in enumerate(ids):
        try:
            stored = check_id(clip_id, new=True)
        except ItemIdError as err:
            skipped[position] = (shown_id(clip_id), f"id outside the id grammar (docs/service.md, \"Ids\"): {err}")
            continue
        if stored in first:
            skipped[position] = (shown_id(clip_id), f"in Unicode NFC the same id as the earlier clip {shown_id(first[stored])!r} "
                                 "(docs/service.md, \"Ids\"): the first is kept")
            continue
        first[stored] = clip_id
        kept[position] = stored
    return kept, skipped
