"""The long-form metrics schema shared by the engine (which writes it) and the report (which reads it)."""
from __future__ import annotations

# The long-form metrics schema, in column order: (name, dtype). "str" = any pandas string dtype.
METRIC_SCHEMA: list[tuple[str, str]] = [
    ("paper", "str"),
    ("experiment", "str"),
    ("method", "str"),
    ("scale", "str"),
    ("dataset", "str"),
    ("seed", "int64"),
    ("round", "int64"),
    ("client", "int64"),
    ("split", "str"),
    ("metric", "str"),
    ("value", "float64"),
]
METRIC_COLUMNS: list[str] = [name for name, _ in METRIC_SCHEMA]
METRIC_DTYPES: dict[str, str] = dict(METRIC_SCHEMA)
