"""Concatenate the per-run metrics Parquet files into one validated table."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from fedcore.io import atomic_path
from fedcore.metrics import METRIC_COLUMNS, METRIC_DTYPES, METRIC_SCHEMA  # noqa: F401 - re-exported

# One row per (run, round, client, split, metric); a duplicate means a run was counted twice.
KEY_COLUMNS: list[str] = [c for c in METRIC_COLUMNS if c != "value"]
SCALES = ("mini", "paper", "smoke")
SPLITS = ("global", "local", "train")


def _dtype_ok(series: pd.Series, dtype: str) -> bool:
    """True when `series` has the schema dtype (strings: any pandas string dtype holding only str)."""
    if dtype == "str":
        return pd.api.types.is_string_dtype(series)
    return series.dtype == np.dtype(dtype)


def validate_metrics(df: pd.DataFrame, source: str) -> None:
    """Raise ValueError naming the column and `source` when `df` does not follow the metrics schema."""
    missing = [c for c in METRIC_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{source}: missing column(s) {missing}; expected {METRIC_COLUMNS}")
    extra = [c for c in df.columns if c not in METRIC_DTYPES]
    if extra:
        raise ValueError(f"{source}: unexpected column(s) {extra}; expected {METRIC_COLUMNS}")
    for name, dtype in METRIC_SCHEMA:
        if not _dtype_ok(df[name], dtype):
            raise ValueError(f"{source}: column '{name}' has dtype {df[name].dtype}, expected {dtype}")
        if dtype == "str" and df[name].isna().any():
            raise ValueError(f"{source}: column '{name}' has missing values")
    _validate_values(df, source)


def _validate_values(df: pd.DataFrame, source: str) -> None:
    """Check the closed vocabularies and index ranges that tables rely on."""
    bad_scale = sorted(set(df["scale"]) - set(SCALES))
    if bad_scale:
        raise ValueError(f"{source}: column 'scale' has values {bad_scale}, expected one of {SCALES}")
    bad_split = sorted(set(df["split"]) - set(SPLITS))
    if bad_split:
        raise ValueError(f"{source}: column 'split' has values {bad_split}, expected one of {SPLITS}")
    if (df["round"] < 1).any():
        raise ValueError(f"{source}: column 'round' must be >= 1 (rounds are 1-indexed)")
    if (df["client"] < -1).any():
        raise ValueError(f"{source}: column 'client' must be >= -1 (-1 = aggregate over clients)")


def _check_duplicates(df: pd.DataFrame, source: str) -> None:
    """Raise when a (run, round, client, split, metric) key appears twice: it would be double-counted."""
    dup = df.duplicated(KEY_COLUMNS, keep=False)
    if dup.any():
        first = df.loc[dup, KEY_COLUMNS].iloc[0].to_dict()
        raise ValueError(f"{source}: {int(dup.sum())} duplicate metric rows, e.g. {first}")


def empty_metrics() -> pd.DataFrame:
    """An empty metrics table with the schema's columns and dtypes."""
    return pd.DataFrame({name: pd.Series([], dtype=dtype) for name, dtype in METRIC_SCHEMA})


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    """Same column order and one string dtype everywhere, so concatenation and round trips are stable."""
    df = df[METRIC_COLUMNS]
    return df.astype({name: dtype for name, dtype in METRIC_SCHEMA})


def aggregate_runs(paths: Sequence[str | os.PathLike], out_path: str | os.PathLike) -> pd.DataFrame:
    """Read, validate and concatenate run Parquets; write the result to `out_path` atomically."""
    frames = []
    for path in paths:
        df = pd.read_parquet(path)
        validate_metrics(df, str(path))
        frames.append(_normalise(df))
    # Validate everything before writing anything: a bad run must not leave a stale-but-new output.
    metrics = pd.concat(frames, ignore_index=True) if frames else empty_metrics()
    metrics = _normalise(metrics).reset_index(drop=True)
    _check_duplicates(metrics, f"aggregated metrics of {len(frames)} run file(s)")
    with atomic_path(Path(out_path)) as tmp:
        metrics.to_parquet(tmp, index=False)
    return metrics
