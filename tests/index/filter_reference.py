"""The filter language of docs/service.md ("Filters"), evaluated in plain Python on one item's metadata.

The reference the filter tests (tests/index/test_filters.py, test_overlay.py) compare index.engines.filters and
the overlay with: written from the documentation, not from index/engines/filters.py. A field the item does not
hold fails every comparison on it (``ne`` too; an empty list holds no value)."""

from __future__ import annotations

from typing import Any


def passes(meta: dict[str, Any], flt: dict[str, Any]) -> bool:
    for key, cond in flt.items():
        if key == "and":
            ok = all(passes(meta, f) for f in cond)
        elif key == "or":
            ok = any(passes(meta, f) for f in cond)
        elif key == "not":
            ok = not passes(meta, cond)
        else:
            ops = cond if isinstance(cond, dict) else {"eq": cond}
            value = meta.get(key)
            ok = value is not None and all(_compare(value, op, operand) for op, operand in ops.items())
        if not ok:
            return False
    return True


def _compare(value: Any, op: str, operand: Any) -> bool:
    if isinstance(value, list):
        held = set(value)
        return {"eq": lambda: operand in held, "ne": lambda: operand not in held and bool(held),
                "in": lambda: bool(held & set(operand)), "any": lambda: bool(held & set(operand)),
                "all": lambda: set(operand) <= held}[op]()
    return {"eq": lambda: value == operand, "ne": lambda: value != operand, "in": lambda: value in operand,
            "lt": lambda: value < operand, "lte": lambda: value <= operand, "gt": lambda: value > operand,
            "gte": lambda: value >= operand}[op]()
