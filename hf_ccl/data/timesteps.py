"""Cutting a timestamp column into time steps (TiC-CLIP's yearly steps), for `stream_by_time`.

A time column is either **numeric** (int years, float times: values compare as numbers) or a **date** column
(Arrow `timestamp`/`date` values, or strings holding ISO-8601 dates such as `"2011"`, `"2011-06"`, `"2011-06-30"`,
`"2011-06-30T12:00:00Z"`). Dates are compared as instants: aware ones are converted to UTC, naive ones are taken as UTC.

Steps are given either as **boundaries** (step end points) or as **explicit groups** of values:

- boundaries `[b0, b1, ..., b_{T-1}]`: step 0 holds every row with `t <= b0`, step i holds `b_{i-1} < t <= b_i`, and
  rows after the last boundary belong to no step (they are dropped). On a date column a boundary that names a whole
  period covers all of it: `2011` or `"2011"` means "up to the end of 2011", `"2011-06"` the end of June 2011,
  `"2011-06-30"` (or a `datetime.date`) the end of that day; a full date-time is an exact instant.
- groups `[[2010, 2011], [2012], ...]`: step i holds the rows whose value equals one of the group's values (on a date
  column: falls within one of the named periods, e.g. the years 2010 and 2011).

Rows without a timestamp belong to no step.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from datasets import Features

TimeKind = Literal["number", "date"]
_NUMBER_TYPES = ("int", "uint", "float", "double", "decimal")
_DATE_TYPES = ("timestamp", "date32", "date64", "string", "large_string")
_NO_TIME = np.datetime64("NaT")


@dataclass(frozen=True)
class Period:
    """A span of time named by one value: `[start, end)` (`end_inclusive=False`) or `[start, end]`."""

    start: Any  # float for numeric columns, np.datetime64[us] for date columns
    end: Any
    end_inclusive: bool
    label: str
    year: int | None = None  # the year, when the value names exactly one year (2011 or "2011")

    def contains(self, keys: np.ndarray) -> np.ndarray:
        upper = keys <= self.end if self.end_inclusive else keys < self.end
        return (keys >= self.start) & upper

    def up_to(self, keys: np.ndarray) -> np.ndarray:
        """Rows at or before this period's end (a boundary's side of the cut)."""
        return keys <= self.end if self.end_inclusive else keys < self.end


def column_kind(features: Features, column: str) -> TimeKind:
    """`"number"` or `"date"` from the column's feature; any other type is an error."""
    feature = features[column]
    dtype = str(getattr(feature, "dtype", ""))
    if dtype.startswith(_NUMBER_TYPES):
        return "number"
    if dtype.startswith(_DATE_TYPES):
        return "date"
    raise ValueError(
        f"Time column {column!r} has feature {feature}; it must hold numbers (years), dates/timestamps or ISO date "
        "strings"
    )


# ----------------------------------------------------------------------------------------------------------------
# Parsing values
# ----------------------------------------------------------------------------------------------------------------


def _utc_naive(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo is None else value.astimezone(dt.timezone.utc).replace(tzinfo=None)


def _month_after(year: int, month: int) -> dt.datetime:
    return dt.datetime(year + month // 12, month % 12 + 1, 1)


def _as_us(value: dt.datetime) -> np.datetime64:
    return np.datetime64(_utc_naive(value), "us")


def _parse_iso(text: str) -> tuple[dt.datetime, dt.datetime | None]:
    """A date string as `(start, end)`: `end` is the exclusive end of the named period, `None` for an instant."""
    text = text.strip()
    parts = text.split("-")
    if len(parts) == 1 and text.isdigit() and len(text) == 4:
        year = int(text)
        return dt.datetime(year, 1, 1), dt.datetime(year + 1, 1, 1)
    if len(parts) == 2 and len(text) == 7 and all(p.isdigit() for p in parts):
        year, month = int(parts[0]), int(parts[1])
        return dt.datetime(year, month, 1), _month_after(year, month)
    if len(text) == 10 and "T" not in text and " " not in text:
        day = dt.date.fromisoformat(text)
        start = dt.datetime(day.year, day.month, day.day)
        return start, start + dt.timedelta(days=1)
    if text.endswith(("Z", "z")):  # fromisoformat accepts "Z" only from Python 3.11
        text = text[:-1] + "+00:00"
    return dt.datetime.fromisoformat(text), None


def _date_period(value: Any) -> Period:
    """A boundary or group value on a date column as the period it names."""
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(f"{value!r} is not a date: use a year (int), an ISO date string, a date or a datetime")
    if isinstance(value, (int, np.integer)):
        year = int(value)
        start, end, label = dt.datetime(year, 1, 1), dt.datetime(year + 1, 1, 1), str(year)
    elif isinstance(value, dt.datetime):
        start, end, label = value, None, value.isoformat()
    elif isinstance(value, dt.date):
        start = dt.datetime(value.year, value.month, value.day)
        end, label = start + dt.timedelta(days=1), value.isoformat()
    elif isinstance(value, str):
        try:
            start, end = _parse_iso(value)
        except ValueError as error:
            raise ValueError(f"Cannot read {value!r} as an ISO-8601 date: {error}") from None
        label = value.strip()
    else:
        raise TypeError(f"{value!r} ({type(value).__name__}) is not a date")
    if end is None:  # an instant
        return Period(_as_us(start), _as_us(start), True, label)
    whole_year = start == dt.datetime(start.year, 1, 1) and end == dt.datetime(start.year + 1, 1, 1)
    return Period(_as_us(start), _as_us(end), False, label, start.year if whole_year else None)


def _number_period(value: Any) -> Period:
    """A boundary or group value on a numeric column: the number itself."""
    if isinstance(value, bool) or isinstance(value, (dt.date, dt.datetime)):
        raise TypeError(f"{value!r} is not a number; the time column holds numbers")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{value!r} is not a number; the time column holds numbers") from None
    year = int(number) if number.is_integer() else None
    label = str(year) if year is not None else str(value)
    return Period(number, number, True, label, year)


def _period(value: Any, kind: TimeKind) -> Period:
    return _number_period(value) if kind == "number" else _date_period(value)


def time_keys(values: Sequence[Any], kind: TimeKind) -> np.ndarray:
    """Comparable keys of a column's values: float64 (NaN when missing) or datetime64[us] (NaT when missing)."""
    if kind == "number":
        return np.asarray([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    keys = np.empty(len(values), dtype="datetime64[us]")
    for i, value in enumerate(values):
        keys[i] = _NO_TIME if value is None else _row_time(value)
    return keys


def _row_time(value: Any) -> np.datetime64:
    if isinstance(value, dt.datetime):
        return _as_us(value)
    if isinstance(value, dt.date):
        return np.datetime64(dt.datetime(value.year, value.month, value.day), "us")
    if isinstance(value, str):
        try:
            return _as_us(_parse_iso(value)[0])
        except ValueError as error:
            raise ValueError(f"Cannot read timestamp {value!r} as an ISO-8601 date: {error}") from None
    if isinstance(value, np.datetime64):
        return value.astype("datetime64[us]")
    raise TypeError(f"Unsupported timestamp {value!r} ({type(value).__name__})")


# ----------------------------------------------------------------------------------------------------------------
# Steps
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeSteps:
    """The steps of a time stream over a column of one kind; `assign` maps timestamps to step indices."""

    kind: TimeKind
    boundaries: tuple[Period, ...] | None = None  # boundary mode
    groups: tuple[tuple[Period, ...], ...] | None = None  # group mode

    @classmethod
    def parse(cls, boundaries: Sequence[Any], kind: TimeKind) -> TimeSteps:
        """Boundaries (all scalars) or explicit groups (all lists/tuples); see the module docstring."""
        if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence) or len(boundaries) == 0:
            raise ValueError(f"boundaries must be a non-empty list of step end points or of groups, got {boundaries!r}")
        grouped = [isinstance(b, (list, tuple)) for b in boundaries]
        if any(grouped) and not all(grouped):
            raise ValueError(
                f"boundaries {list(boundaries)!r} mixes end points and groups: give all end points "
                "([2011, 2012, 2015]) or all groups ([[2010, 2011], [2012], [2013, 2014, 2015]])"
            )
        if all(grouped):
            return cls._from_groups(boundaries, kind)
        periods = tuple(_period(value, kind) for value in boundaries)
        for before, after in itertools.pairwise(periods):
            if not after.end > before.end:
                raise ValueError(
                    f"boundaries must increase strictly: {before.label!r} is followed by {after.label!r}"
                )
        return cls(kind, boundaries=periods)

    @classmethod
    def _from_groups(cls, groups: Sequence[Sequence[Any]], kind: TimeKind) -> TimeSteps:
        parsed = []
        for group in groups:
            if len(group) == 0:
                raise ValueError(f"boundaries: every group needs at least one value, got {list(groups)!r}")
            parsed.append(tuple(_period(value, kind) for value in group))
        labels = [p.label for group in parsed for p in group]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"boundaries: value(s) {repeated} appear in more than one group")
        return cls(kind, groups=tuple(parsed))

    def _groups(self) -> tuple[tuple[Period, ...], ...]:
        assert self.groups is not None, "a TimeSteps holds boundaries or groups"
        return self.groups

    def __len__(self) -> int:
        return len(self.boundaries) if self.boundaries is not None else len(self._groups())

    def assign(self, values: Sequence[Any]) -> np.ndarray:
        """The step index of every value (int64), or -1 for values in no step (after the last boundary, not in
        any group, or missing)."""
        keys = time_keys(values, self.kind)
        steps = np.full(len(keys), -1, dtype=np.int64)
        if self.boundaries is not None:
            for index in reversed(range(len(self.boundaries))):  # the earliest step whose end covers t wins
                steps[self.boundaries[index].up_to(keys)] = index
            return steps
        for index, group in enumerate(self._groups()):
            for period in group:
                steps[period.contains(keys)] = index
        return steps

    def names(self) -> list[str]:
        """Step names: `"2012"` or `"2013-2015"` for year steps (the first step of boundaries is named by its last
        year, as TiC-CLIP labels its merged first step), `"a..b"` between other boundaries, `"a+b"` for groups."""
        if self.boundaries is not None:
            return [self._boundary_name(i) for i in range(len(self.boundaries))]
        return [_group_name(group) for group in self._groups()]

    def _boundary_name(self, index: int) -> str:
        assert self.boundaries is not None
        current = self.boundaries[index]
        if index == 0:
            return current.label
        previous = self.boundaries[index - 1]
        if current.year is not None and previous.year is not None:
            first = previous.year + 1
            return str(current.year) if first == current.year else f"{first}-{current.year}"
        return f"{previous.label}..{current.label}"


def _group_name(group: tuple[Period, ...]) -> str:
    years = [p.year for p in group if p.year is not None]
    if len(group) > 1 and len(years) == len(group) and sorted(years) == list(range(min(years), max(years) + 1)):
        return f"{min(years)}-{max(years)}"
    return "+".join(p.label for p in group)
