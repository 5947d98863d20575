"""Metadata filters over a catalogue's items: the structured filter language and its evaluation.

Where a filter is evaluated: here, in numpy, over a columnar :class:`MetadataTable` built from the
items' metadata (``audio_ids.jsonl`` rows of a bundle). The result is a boolean mask over the
index rows that the vector backends take (:meth:`index.engines.vector_index.FaissVectorIndex.search`).
On the Milvus backend the same tree is also written as a Milvus boolean expression
(:func:`milvus_expr`) over the metadata published with the vectors, and Milvus evaluates it
(:meth:`index.engines.milvus_index.MilvusVectorIndex.search`); the mask still checks fields and types.
No expression string is ever evaluated: a filter is a small JSON object (docs/service.md, Filters).

Grammar (JSON):

* ``{}`` — every item.
* ``{"license": "cc0"}`` — equality on a field (on a list-of-strings field: the list holds it).
* ``{"duration": {"lte": 5}}`` — operators on a field: ``eq``, ``ne``, ``in`` (a list),
  ``lt``/``lte``/``gt``/``gte`` (numbers), ``any``/``all`` (lists of strings, on list fields);
  several operators on one field all hold.
* ``{"and": [f, ...]}``, ``{"or": [f, ...]}``, ``{"not": f}`` — combinations; several keys in one
  object all hold (an implicit ``and``).

An item without a value for a field fails every comparison on that field (``ne`` included);
``not`` inverts, so ``{"not": {"license": "cc0"}}`` keeps items without a license.

Two checks, two moments: :func:`parse_filter` checks the form and its limits (depth, clauses,
list sizes, string lengths: :data:`MAX_DEPTH` …) without knowing a catalogue;
:meth:`MetadataTable.mask` checks fields and operand types against the catalogue. Both raise
:class:`FilterError`, a user error (the service's 422).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from index.errors import TonearmError

MAX_DEPTH = 8
"""Deepest nesting of ``and``/``or``/``not`` (the top-level object is depth 1)."""
MAX_CLAUSES = 64
"""Most field comparisons and combinators in one filter, all levels together."""
MAX_VALUES = 1024
"""Most values in one ``in``/``any``/``all`` list."""
MAX_FIELD_CHARS = 64
MAX_STRING_CHARS = 256
COMBINATORS = ("and", "or", "not")
OPERATORS = ("eq", "ne", "in", "lt", "lte", "gt", "gte", "any", "all")
RANGE_OPERATORS = ("lt", "lte", "gt", "gte")
SKIPPED_FIELDS = ("captions",)
"""Item keys that are not metadata (captions are searched as text, not filtered)."""

Kind = Literal["string", "number", "boolean", "strings"]
Scalar = str | float | bool


class FilterError(TonearmError):
    """A filter that is malformed, too large, or names a field or type the catalogue does not have."""


# ----------------------------------------------------------------------------- the parsed form


@dataclass(frozen=True)
class Compare:
    field: str
    op: str
    value: Scalar | tuple[Scalar, ...]


@dataclass(frozen=True)
class Combine:
    op: Literal["and", "or", "not"]
    parts: tuple[Node, ...]


Node = Compare | Combine


@dataclass(frozen=True)
class Filter:
    """A parsed filter: its tree and its canonical JSON (a stable key for caches and logs)."""

    root: Node
    canonical: str

    @property
    def matches_all(self) -> bool:
        return isinstance(self.root, Combine) and self.root.op == "and" and not self.root.parts


def _scalar(value: Any, where: str) -> Scalar:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise FilterError(f"{where}: numbers must be finite (and within ±1.8e308)")
        return number
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise FilterError(f"{where}: strings are limited to {MAX_STRING_CHARS} characters")
        return value
    raise FilterError(f"{where}: expected a string, number or boolean, got {_json_type(value)}")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


class _Parser:
    def __init__(self) -> None:
        self.clauses = 0

    def count(self, where: str) -> None:
        self.clauses += 1
        if self.clauses > MAX_CLAUSES:
            raise FilterError(f"{where}: a filter has at most {MAX_CLAUSES} clauses")

    def node(self, obj: Any, depth: int, where: str) -> Node:
        if depth > MAX_DEPTH:
            raise FilterError(f"{where}: filters nest at most {MAX_DEPTH} levels deep")
        if not isinstance(obj, dict):
            raise FilterError(f"{where}: a filter is a JSON object, got {_json_type(obj)}")
        parts = [self.clause(key, value, depth, f"{where}.{key}") for key, value in obj.items()]
        return parts[0] if len(parts) == 1 else Combine("and", tuple(parts))

    def clause(self, key: Any, value: Any, depth: int, where: str) -> Node:
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_FIELD_CHARS:
            raise FilterError(f"{where}: field names are 1–{MAX_FIELD_CHARS} characters")
        self.count(where)
        if key in ("and", "or"):
            if not isinstance(value, list) or not value:
                raise FilterError(f"{where}: '{key}' takes a non-empty list of filters")
            if len(value) > MAX_CLAUSES:
                raise FilterError(f"{where}: '{key}' takes at most {MAX_CLAUSES} filters")
            op: Literal["and", "or"] = "and" if key == "and" else "or"
            return Combine(op, tuple(self.node(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value)))
        if key == "not":
            return Combine("not", (self.node(value, depth + 1, where),))
        if isinstance(value, dict):
            if not value:
                raise FilterError(f"{where}: an operator object needs at least one of {', '.join(OPERATORS)}")
            ops = [self.operator(key, op, operand, f"{where}.{op}") for op, operand in value.items()]
            return ops[0] if len(ops) == 1 else Combine("and", tuple(ops))
        return Compare(key, "eq", _scalar(value, where))

    def operator(self, field: str, op: Any, operand: Any, where: str) -> Compare:
        if op not in OPERATORS:
            raise FilterError(f"{where}: unknown operator {op!r}; use one of {', '.join(OPERATORS)}")
        if op in ("in", "any", "all"):
            if not isinstance(operand, list) or not operand:
                raise FilterError(f"{where}: '{op}' takes a non-empty list")
            if len(operand) > MAX_VALUES:
                raise FilterError(f"{where}: '{op}' takes at most {MAX_VALUES} values, got {len(operand)}")
            values = tuple(_scalar(v, f"{where}[{i}]") for i, v in enumerate(operand))
            if op in ("any", "all") and not all(isinstance(v, str) for v in values):
                raise FilterError(f"{where}: '{op}' takes a list of strings")
            if len({type(v) for v in values}) > 1:
                raise FilterError(f"{where}: the values of '{op}' must all have one type")
            return Compare(field, op, values)
        value = _scalar(operand, where)
        if op in RANGE_OPERATORS and (isinstance(value, bool) or not isinstance(value, float)):
            raise FilterError(f"{where}: '{op}' takes a number, got {_json_type(operand)}")
        return Compare(field, op, value)


def parse_filter(obj: Any) -> Filter:
    """Check a filter's form and limits (no catalogue needed); :class:`FilterError` if it is not one."""
    root = _Parser().node(obj, 1, "filter")
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        canonical.encode("utf-8")  # JSON's "\ud800" decodes to a lone surrogate, which no catalogue value holds
    except UnicodeEncodeError as err:
        raise FilterError(f"filter: {err.object[err.start]!r} is a lone surrogate, not valid Unicode") from None
    return Filter(root=root, canonical=canonical)


# ----------------------------------------------------------------------------- the columnar table


def _kind_of(value: Any) -> Kind | None:
    """The filterable kind of one metadata value (None: not filterable, e.g. an object)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "strings"
    return None


def item_metadata(item: Mapping[str, Any]) -> dict[str, Any]:
    """The filterable metadata of one catalogue row: its top-level keys (``captions`` aside) and the
    keys of its ``metadata`` object, a top-level key winning over a metadata key of the same name."""
    nested = item.get("metadata")
    out = dict(nested) if isinstance(nested, dict) else {}
    out.update({k: v for k, v in item.items() if k not in SKIPPED_FIELDS and k != "metadata"})
    return out


def filterable_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a clip's free-form metadata a filter can use (strings, numbers, booleans, lists of
    strings), as written into a bundle's ``audio_ids.jsonl`` ``metadata`` object."""
    return {str(k): v for k, v in meta.items() if _kind_of(v) is not None}


class _Vocabulary:
    def __init__(self) -> None:
        self.codes: dict[str, int] = {}

    def code(self, value: str) -> int:
        return self.codes.setdefault(value, len(self.codes))

    def lookup(self, values: Iterable[Any]) -> np.ndarray:
        return np.array([self.codes.get(v, -2) for v in values if isinstance(v, str)], dtype=np.int64)


@dataclass
class Column:
    """One field's values over every row: strings as vocabulary codes (-1 missing), numbers as
    float64 (NaN missing), booleans as int8 (-1 missing), lists of strings as (row, code) pairs."""

    kind: Kind | Literal["mixed"]
    values: np.ndarray  # per row; for "strings": codes of the (row, code) pairs
    vocabulary: _Vocabulary | None = None
    rows: np.ndarray | None = None  # "strings": the row of each pair


class MetadataTable:
    """The catalogue's metadata as columns, one row per index row; :meth:`mask` evaluates a filter."""

    def __init__(self, n_rows: int, columns: dict[str, Column]) -> None:
        self.n_rows = n_rows
        self.columns = columns

    @classmethod
    def from_items(cls, items: Sequence[Mapping[str, Any]]) -> MetadataTable:
        """Columns of every field any item carries; a field whose values have several kinds is
        ``mixed`` (named in errors, never filterable); ``null`` is a missing value."""
        n = len(items)
        metas = [item_metadata(item) for item in items]
        kinds: dict[str, set[str]] = {}
        for meta in metas:
            for key, value in meta.items():
                if value is None:
                    continue
                kinds.setdefault(key, set()).add(_kind_of(value) or "other")
        columns: dict[str, Column] = {}
        for key, seen in kinds.items():
            if seen == {"other"}:
                continue  # objects only (not filterable)
            if len(seen) > 1:
                columns[key] = Column("mixed", np.zeros(0))
                continue
            kind: Kind = seen.pop()  # type: ignore[assignment]
            columns[key] = _column(kind, [meta.get(key) for meta in metas], n)
        return cls(n, columns)

    def fields(self) -> dict[str, str]:
        """Field name → kind (``string``, ``number``, ``boolean``, ``strings``, ``mixed``)."""
        return {name: column.kind for name, column in sorted(self.columns.items())}

    def mask(self, flt: Filter, *, fields: Mapping[str, str] | None = None) -> np.ndarray:
        """Boolean mask of the rows that pass; :class:`FilterError` for unknown fields or wrong types.

        ``fields`` (:func:`merged_fields` of several tables: the bundle's clips and the items added
        through the API) are the catalogue's fields when this table is one part of it: a field the
        catalogue has and this table lacks is missing on every row here (no row passes a comparison
        on it), and its type is checked against the catalogue's kind."""
        return self._eval(flt.root, self.fields() if fields is None else dict(fields))

    def _eval(self, node: Node, fields: dict[str, str]) -> np.ndarray:
        if isinstance(node, Combine):
            if node.op == "not":
                return ~self._eval(node.parts[0], fields)
            out = np.full(self.n_rows, node.op == "and", dtype=bool)
            for part in node.parts:
                if node.op == "and":
                    out &= self._eval(part, fields)
                else:
                    out |= self._eval(part, fields)
            return out
        return self._compare(node, fields)

    @staticmethod
    def _kind(name: str, fields: dict[str, str]) -> str:
        kind = fields.get(name)
        if kind is None:
            known = ", ".join(sorted(fields)) or "none"
            raise FilterError(f"filter field {name!r} is not in the catalogue; fields: {known}")
        if kind == "mixed":
            raise FilterError(f"filter field {name!r} holds values of several types and cannot be filtered on")
        return kind

    def _compare(self, node: Compare, fields: dict[str, str]) -> np.ndarray:
        kind = self._kind(node.field, fields)
        values = node.value if isinstance(node.value, tuple) else (node.value,)
        expected = {"string": str, "number": float, "boolean": bool, "strings": str}[kind]
        if any(type(v) is not expected for v in values):
            got = _json_type(values[0]) if values else "nothing"
            raise FilterError(
                f"filter field {node.field!r} holds {_kind_name(kind)}; '{node.op}' was given {got}"
            )
        if node.op in RANGE_OPERATORS and kind != "number":
            raise FilterError(f"filter field {node.field!r} holds {_kind_name(kind)}: '{node.op}' needs numbers")
        if node.op in ("any", "all") and kind != "strings":
            raise FilterError(f"filter field {node.field!r} holds {_kind_name(kind)}: '{node.op}' needs a list field")
        if kind == "strings" and node.op not in ("eq", "ne", "in", "any", "all"):
            raise FilterError(f"filter field {node.field!r} holds lists of strings: use eq, ne, any, all or in")
        column = self.columns.get(node.field)
        if column is None:  # the catalogue has the field, this part of it does not: missing everywhere
            return np.zeros(self.n_rows, dtype=bool)
        if column.kind == "strings":
            return self._strings(column, node.op, values, node.field)
        data = column.values
        if column.kind == "number":
            present = ~np.isnan(data)
            wanted = np.asarray(values, dtype=np.float64)
        elif column.kind == "boolean":
            present = data >= 0
            wanted = np.asarray(values, dtype=np.int8)
        else:
            assert column.vocabulary is not None
            present = data >= 0
            wanted = column.vocabulary.lookup(values)
        op = node.op
        if op == "eq":
            return data == wanted[0] if wanted.size else np.zeros(self.n_rows, bool)
        if op == "ne":
            return present & (data != wanted[0]) if wanted.size else present
        if op == "in":
            return np.isin(data, wanted)
        bound = float(values[0])
        with np.errstate(invalid="ignore"):
            return {"lt": data < bound, "lte": data <= bound, "gt": data > bound, "gte": data >= bound}[op]

    def _strings(self, column: Column, op: str, values: tuple[Scalar, ...], field: str) -> np.ndarray:
        assert column.vocabulary is not None and column.rows is not None
        if op not in ("eq", "ne", "in", "any", "all"):
            raise FilterError(f"filter field {field!r} holds lists of strings: use eq, ne, any, all or in")
        wanted = np.unique(column.vocabulary.lookup(values))
        hit = np.isin(column.values, wanted)
        counts = np.bincount(column.rows[hit], minlength=self.n_rows)
        if op == "all":
            return counts >= len(set(values)) if wanted.size == len(set(values)) else np.zeros(self.n_rows, bool)
        if op == "ne":
            has_list = np.bincount(column.rows, minlength=self.n_rows) > 0
            return has_list & (counts == 0)
        return counts > 0


def merged_fields(tables: Sequence[MetadataTable]) -> dict[str, str]:
    """The fields of a catalogue made of several tables (name → kind); a field whose kind differs
    between tables is ``mixed``."""
    return merged_kinds([table.fields() for table in tables])


def merged_kinds(kinds: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Field kinds of several parts of one catalogue (name → kind); a field whose kind differs between
    parts is ``mixed``."""
    out: dict[str, str] = {}
    for part in kinds:
        for name, kind in part.items():
            out[name] = kind if out.get(name, kind) == kind else "mixed"
    return dict(sorted(out.items()))


def _kind_name(kind: str) -> str:
    return {"string": "strings", "number": "numbers", "boolean": "booleans", "strings": "lists of strings"}.get(
        kind, kind
    )


def _column(kind: Kind, values: list[Any], n: int) -> Column:
    if kind == "number":
        return Column(kind, np.array([v if _kind_of(v) == "number" else np.nan for v in values], dtype=np.float64))
    if kind == "boolean":
        return Column(kind, np.array([-1 if v is None else int(v) for v in values], dtype=np.int8))
    vocabulary = _Vocabulary()
    if kind == "string":
        return Column(kind, np.array([-1 if v is None else vocabulary.code(v) for v in values], dtype=np.int64),
                      vocabulary)
    rows: list[int] = []
    codes: list[int] = []
    for row, value in enumerate(values):
        for code in sorted({vocabulary.code(v) for v in value or ()}):  # a repeated tag counts once
            rows.append(row)
            codes.append(code)
    return Column(kind, np.array(codes, dtype=np.int64), vocabulary, np.array(rows, dtype=np.int64))


# ----------------------------------------------------------------------------- JSON Schema

_STRING = {"type": "string", "maxLength": MAX_STRING_CHARS}
_SCALARS: dict[str, dict[str, Any]] = {
    "string": _STRING,
    "number": {"type": "number"},
    "boolean": {"type": "boolean"},
    "strings": _STRING,
}


def _values(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "minItems": 1, "maxItems": MAX_VALUES, "items": item}


def _condition(kind: str) -> dict[str, Any]:
    """What a field of ``kind`` may be compared with: a value (equality) or an operator object."""
    scalar = _SCALARS[kind]
    ops: dict[str, Any] = {"eq": scalar, "ne": scalar, "in": _values(scalar)}
    if kind == "number":
        ops.update(dict.fromkeys(RANGE_OPERATORS, scalar))
    if kind == "strings":
        ops.update({"any": _values(scalar), "all": _values(scalar)})
    return {"anyOf": [scalar, {"type": "object", "properties": ops, "additionalProperties": False, "minProperties": 1}]}


def _generic_condition() -> dict[str, Any]:
    scalar = {"anyOf": [_STRING, {"type": "number"}, {"type": "boolean"}]}
    ops: dict[str, Any] = dict.fromkeys(("eq", "ne", *RANGE_OPERATORS), scalar)
    ops.update({op: _values(scalar) for op in ("in", "any", "all")})
    return {"anyOf": [*scalar["anyOf"], {"type": "object", "properties": ops, "additionalProperties": False,
                                          "minProperties": 1}]}


def filter_json_schema_name(depth: int) -> str:
    return "Filter" if depth == 1 else f"FilterLevel{depth}"


def filter_json_schemas(fields: Mapping[str, str] | None, *, ref_prefix: str = "#/components/schemas/") -> dict[str, Any]:
    """JSON Schemas of the filter language, one per nesting level (``Filter`` is the top; JSON Schema
    cannot count depth, so the levels are unrolled to :data:`MAX_DEPTH`). With ``fields`` (a
    catalogue's :meth:`MetadataTable.fields`) only those fields, each with the operators of its kind;
    without, any field name. The total clause count (:data:`MAX_CLAUSES`) is checked by the server."""
    if fields is None:
        conditions: dict[str, Any] = {}
        extra: Any = _generic_condition()
    else:
        conditions = {name: _condition(kind) for name, kind in fields.items()
                      if kind != "mixed" and name not in COMBINATORS and len(name) <= MAX_FIELD_CHARS}
        extra = False
    schemas = {}
    for depth in range(1, MAX_DEPTH + 1):
        properties = dict(conditions)
        if depth < MAX_DEPTH:
            child = {"$ref": ref_prefix + filter_json_schema_name(depth + 1)}
            combined = {"type": "array", "minItems": 1, "maxItems": MAX_CLAUSES, "items": child}
            properties.update({"and": combined, "or": combined, "not": child})
        schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": extra}
        if fields is None:
            schema["propertyNames"] = {"minLength": 1, "maxLength": MAX_FIELD_CHARS}
        if depth == 1:
            schema["title"] = "Filter"
            schema["description"] = (
                "Metadata filter (docs/service.md, Filters): `{field: value}` is equality, "
                "`{field: {op: value}}` applies eq, ne, in, lt, lte, gt, gte, any, all; `and`/`or` take lists "
                f"of filters, `not` one; several keys all hold. At most {MAX_DEPTH} levels, {MAX_CLAUSES} clauses, "
                f"{MAX_VALUES} values in a list."
            )
        schemas[filter_json_schema_name(depth)] = schema
    return schemas


# ----------------------------------------------------------------------------- Milvus expressions

MILVUS_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
"""The escapes both Milvus parsers read alike (the 2.3 server's and milvus-lite 3.x's): milvus-lite
knows no ``\\u``/``\\x``/octal escapes, so every other character is written as itself (UTF-8)."""


def milvus_string(value: str) -> str | None:
    """``value`` as a double-quoted Milvus string literal; None when it holds a character neither
    parser reads back (a control character other than tab, CR and LF, or a lone surrogate)."""
    out = ['"']
    for ch in value:
        escaped = MILVUS_ESCAPES.get(ch)
        if escaped is not None:
            out.append(escaped)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or 0xD800 <= ord(ch) <= 0xDFFF:
            return None
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


class _Inexpressible(Exception):
    pass


def milvus_expr(flt: Filter, fields: Mapping[str, str], *, json_field: str = "meta", row_field: str = "row",
                in_operator: bool = True) -> str | None:
    """The Milvus boolean expression equivalent to ``flt`` over a collection whose ``json_field`` (a
    JSON field) holds each row's metadata as published (:func:`milvus_metadata`), ``fields`` its
    kinds (:meth:`MetadataTable.fields`); None when ``flt`` cannot be written as one (a field the
    collection does not have or holds several types in, an operand of another type, a string no
    parser reads back: :func:`milvus_string`) — the caller then filters on its own side.

    Never a request string unescaped: field names and string values go through
    :func:`milvus_string`, numbers through ``repr(float)``, booleans as ``true``/``false``; nothing
    else of the request reaches the expression.

    Semantics equal :meth:`MetadataTable.mask`'s on both engines: every comparison is guarded by
    ``exists`` — Milvus 2.3 answers ``!=`` on a missing key with true, milvus-lite 3.x answers every
    comparison on a missing key with null (three-valued: ``not`` of it stays false), so with the
    guard a comparison on a missing key is false and ``not`` inverts it. ``in`` is Milvus's ``in``
    (``in_operator``; milvus-lite 3.x has none on JSON keys: a chain of ``or``). ``{}`` is
    ``row >= 0``."""
    try:
        return _MilvusWriter(fields, json_field, row_field, in_operator).node(flt.root)
    except _Inexpressible:
        return None


@dataclass(frozen=True)
class _MilvusWriter:
    fields: Mapping[str, str]
    json_field: str
    row_field: str
    in_operator: bool

    def node(self, node: Node) -> str:
        if isinstance(node, Compare):
            return self.compare(node)
        if node.op == "not":
            return f"(not {self.node(node.parts[0])})"
        if not node.parts:
            return f"({self.row_field} >= 0)" if node.op == "and" else f"({self.row_field} < 0)"
        return "(" + f" {node.op} ".join(self.node(part) for part in node.parts) + ")"

    def literal(self, value: Scalar) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            return repr(value)
        text = milvus_string(value)
        if text is None:
            raise _Inexpressible
        return text

    def compare(self, node: Compare) -> str:
        kind = self.fields.get(node.field)
        values = node.value if isinstance(node.value, tuple) else (node.value,)
        expected = {"string": str, "number": float, "boolean": bool, "strings": str}.get(kind or "")
        if expected is None or any(type(v) is not expected for v in values):
            raise _Inexpressible  # unknown or mixed field, or another type: MetadataTable says why
        key = milvus_string(node.field)
        if key is None:
            raise _Inexpressible
        path = f"{self.json_field}[{key}]"
        literals = [self.literal(v) for v in values]
        op = node.op
        if kind == "strings":
            if op == "eq":
                test = f"json_contains({path}, {literals[0]})"
            elif op == "ne":
                test = f"not json_contains({path}, {literals[0]})"
            elif op in ("in", "any"):
                test = f"json_contains_any({path}, [{', '.join(literals)}])"
            elif op == "all":
                test = f"json_contains_all({path}, [{', '.join(literals)}])"
            else:
                raise _Inexpressible
        elif op == "in":
            if self.in_operator and kind != "boolean":
                test = f"{path} in [{', '.join(literals)}]"
            else:
                test = " or ".join(f"{path} == {lit}" for lit in literals)
        elif op in ("any", "all"):
            raise _Inexpressible
        else:
            symbol = {"eq": "==", "ne": "!=", "lt": "<", "lte": "<=", "gt": ">", "gte": ">="}[op]
            test = f"{path} {symbol} {literals[0]}"
        return f"((exists {path}) and ({test}))"


def milvus_metadata(item: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """The JSON object a catalogue row is published with (Milvus's ``meta`` field): its filterable
    metadata (:func:`item_metadata`) limited to ``fields`` of one kind (not ``mixed``); ``null`` and
    empty lists left out (both are missing values to :class:`MetadataTable`)."""
    out: dict[str, Any] = {}
    for key, value in item_metadata(item).items():
        kind = fields.get(key)
        if kind in (None, "mixed") or value is None or value == []:
            continue
        if _kind_of(value) == kind:
            out[key] = value
    return out
