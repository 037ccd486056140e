"""Load task rows from local files, validate them and filter them offline.

Everything here is local: no hub downloads, ever. A hub dataset is used by
pointing at a folder written by ``save_to_disk`` or at a local snapshot of its
files. Every row that goes in is accounted for in ``LoadResult.counts``::

    read == malformed + filtered_solve_rate + missing_solve_rate + kept

so a filter that silently eats the dataset shows up in the summary line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from swarmrl.data.schema import (
    RECORD_FIELD,
    Checks,
    RowError,
    TaskRow,
    describe_json_error,
    parse_row,
)

logger = logging.getLogger("swarmrl.data")

ACCEPTED_FORMATS = (
    "a .jsonl file, a .parquet file, a .json file holding a list of rows, "
    "a folder written by datasets' save_to_disk, or a folder of *.parquet / *.jsonl files"
)
#: Malformed rows logged one by one before switching to a count, so a broken
#: file does not flood the log.
LOG_ERRORS_LIMIT = 20
#: RowErrors quoted in the exception raised with on_malformed="error".
RAISE_ERRORS_LIMIT = 10
_BATCH = 1024
_KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev")

# One raw record from a reader: (1-based row, record, why it could not be parsed).
_Raw = tuple[int, Any, str | None]


@dataclass
class LoadResult:
    """Rows that passed, why the others did not, and the tally of both."""

    rows: list[TaskRow]
    errors: list[RowError]
    counts: dict[str, int]
    source: str = ""

    def summary(self) -> str:
        """One line for logs: where from, how many kept, and where the rest went."""
        c = self.counts
        return (
            f"tasks from {self.source or '?'}: kept {c.get('kept', 0)} of {c.get('read', 0)} read"
            f" (malformed {c.get('malformed', 0)},"
            f" outside solve-rate range {c.get('filtered_solve_rate', 0)},"
            f" missing solve rate {c.get('missing_solve_rate', 0)})"
        )

    def task_type_counts(self) -> dict[str, int]:
        """Kept rows per task type, to spot a mix that differs from what was intended."""
        return dict(Counter(row.task_type for row in self.rows))


# ---------------------------------------------------------------------------
# Readers: each yields (row, record, parse_error) and never validates.


def _read_jsonl_lines(lines: Iterable[str]) -> Iterator[_Raw]:
    """Yield one record per non-blank line, numbered by line so editors can jump to it."""
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) are not rows
        try:
            yield line_no, json.loads(line), None
        except json.JSONDecodeError as err:
            yield line_no, None, describe_json_error(err)


def _read_jsonl(path: Path) -> Iterator[_Raw]:
    with path.open(encoding="utf-8") as handle:
        yield from _read_jsonl_lines(handle)


def _read_json(path: Path) -> Iterator[_Raw]:
    """A .json file holding a list; one starting with '{' is read as JSON Lines.

    ``datasets``' ``to_json`` writes JSON Lines under a .json name by default,
    so refusing those would only make users rename files.
    """
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        yield from _read_jsonl_lines(text.splitlines())
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: {describe_json_error(err)}; expected a JSON list of rows") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows (or JSON Lines), got {type(data).__name__}")
    for index, record in enumerate(data, start=1):
        yield index, record, None


def _read_parquet(path: Path) -> Iterator[_Raw]:
    """Stream record batches so a large file is not materialised twice."""
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for corrupt files
        raise ValueError(f"{path}: cannot read as parquet ({err})") from err
    with handle:
        index = 0
        for batch in handle.iter_batches(batch_size=_BATCH):
            for record in batch.to_pylist():
                index += 1
                yield index, record, None


def _is_saved_dataset(path: Path) -> bool:
    """Folders written by Dataset/DatasetDict.save_to_disk carry these marker files."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _read_saved_dataset(path: Path, split: str | None) -> Iterator[_Raw]:
    import datasets  # imported lazily: slow to import, and only needed here

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise ValueError(f"{path} has splits {sorted(loaded)}, not {name!r}; pass split= one of them")
        ds = loaded[name]
    else:
        if split is not None:
            raise ValueError(f"{path} is a single Dataset without splits; drop split={split!r}")
        ds = loaded
    index = 0
    for batch in ds.iter(batch_size=_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            index += 1
            yield index, dict(zip(columns, values)), None


def _split_of(relative: Path) -> str | None:
    """The split a file belongs to by hub naming: ``train-00000-of-00001.parquet``,
    ``train.jsonl`` or ``train/...``; None if the name says nothing."""
    stem = relative.name.split(".", 1)[0]
    match = re.match(r"^(.+?)-\d+-of-\d+$", stem)
    if match:
        return match.group(1)
    if stem in _KNOWN_SPLITS:
        return stem
    for part in relative.parts[:-1]:
        if part in _KNOWN_SPLITS:
            return part
    return None


def _data_files(folder: Path, split: str | None) -> list[Path]:
    """The *.parquet / *.jsonl files under ``folder`` to read, in sorted order.

    With ``split`` given, only that split's files. Without, the "train" files
    if the names mark splits (so a snapshot's test split never leaks into
    training), otherwise every file. Hidden folders (.cache, .git) are skipped.
    """
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix in (".parquet", ".jsonl")
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise FileNotFoundError(f"no *.parquet or *.jsonl files under {folder}; expected {ACCEPTED_FORMATS}")
    splits = {p: _split_of(p.relative_to(folder)) for p in files}
    wanted = split or ("train" if "train" in splits.values() else None)
    if wanted is None:
        return files
    chosen = [p for p in files if splits[p] == wanted]
    if not chosen:
        found = sorted({s for s in splits.values() if s}) or ["none marked"]
        raise ValueError(
            f"no files for split {wanted!r} under {folder} (splits found: {found}); pass split= one of them"
        )
    skipped = [str(p.relative_to(folder)) for p in files if p not in chosen]
    if skipped:
        logger.info("split %r: not reading %d other file(s): %s", wanted, len(skipped), skipped)
    return chosen


def _sources(path: Path, split: str | None) -> list[tuple[str | None, Iterator[_Raw]]]:
    """Pick readers for ``path``: (label for RowError.source, raw records)."""
    if not path.exists():
        raise FileNotFoundError(f"task source {path} does not exist; expected {ACCEPTED_FORMATS}")
    if path.is_dir():
        if _is_saved_dataset(path):
            return [(None, _read_saved_dataset(path, split))]
        files = _data_files(path, split)
        # Row numbers restart per file, so name the file when there are several.
        label = (lambda p: str(p.relative_to(path))) if len(files) > 1 else (lambda p: None)
        return [(label(p), read_records(p)) for p in files]
    if split is not None:
        raise ValueError(f"{path} is a single file; split={split!r} only applies to folders")
    return [(None, read_records(path))]


def read_records(path: Path) -> Iterator[_Raw]:
    """The records of one .jsonl, .json or .parquet file, unvalidated, as (1-based row, record, why it
    could not be parsed or None); ValueError for another extension."""
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"cannot read {path}: unknown extension; expected {ACCEPTED_FORMATS}")
    return reader(path)


# ---------------------------------------------------------------------------
# Filtering and bookkeeping.


def _solve_rate(value: Any) -> float | None:
    """A usable solve rate, or None when missing (null, or NaN as pandas writes nulls).

    Raises ValueError for values that are present but not numbers.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"solve rate must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value):
        return None
    return float(value)


def _solve_rate_verdict(task: TaskRow, column: str | None, bounds: tuple[float, float] | None) -> str:
    """Which ``counts`` key a valid row lands in: kept, or the reason it was dropped."""
    if bounds is None or column is None:
        return "kept"
    rate = _solve_rate(task.column(column))
    if rate is None:
        return "missing_solve_rate"
    if not bounds[0] <= rate <= bounds[1]:
        return "filtered_solve_rate"
    return "kept"


def _check_arguments(
    solve_rate_column: str | None,
    solve_rate_range: tuple[float, float] | None,
    on_malformed: str,
    limit: int | None,
) -> None:
    """Reject nonsensical settings before reading a possibly large file."""
    if on_malformed not in ("skip", "error"):
        raise ValueError(f"on_malformed must be 'skip' or 'error', got {on_malformed!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    if solve_rate_range is None:
        return
    if solve_rate_column is None:
        raise ValueError(
            "solve_rate_range needs solve_rate_column: say which column holds the solve "
            "rate (e.g. 'solve_rate_qwen_r1_distill_7b')"
        )
    try:
        lo, hi = (float(v) for v in solve_rate_range)
    except (TypeError, ValueError):
        raise ValueError(f"solve_rate_range must be two numbers (lo, hi), got {solve_rate_range!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValueError(f"solve_rate_range must satisfy lo <= hi, got {solve_rate_range!r}")


def load_tasks(
    source: str | os.PathLike[str],
    *,
    solve_rate_column: str | None = None,
    solve_rate_range: tuple[float, float] | None = None,
    on_malformed: Literal["skip", "error"] = "skip",
    limit: int | None = None,
    split: str | None = None,
    checks: Checks | None = None,
) -> LoadResult:
    """Read, validate and solve-rate-filter tasks from a local file or folder.

    ``limit`` caps the number of *kept* rows; reading stops as soon as it is
    reached, so counts then cover only the part read. ``solve_rate_column``
    without a range filters nothing but is still checked to exist, so a typo
    fails loudly. With ``on_malformed="error"`` the whole source is read first,
    then a ValueError lists the problems, so one run shows them all.
    ``checks`` are the task types' checks of ``verification_info``
    (``swarmrl.rewards.registry.checks()``); without them only the common shape
    is checked.
    """
    _check_arguments(solve_rate_column, solve_rate_range, on_malformed, limit)
    path = Path(source)
    counts = dict.fromkeys(("read", "malformed", "filtered_solve_rate", "missing_solve_rate", "kept"), 0)
    rows: list[TaskRow] = []
    errors: list[RowError] = []
    seen_columns: set[str] = set()
    column_seen = solve_rate_column is None

    def refuse(new_errors: list[RowError]) -> None:
        if counts["malformed"] < LOG_ERRORS_LIMIT:
            for err in new_errors:
                logger.warning("malformed task: %s", err)
        counts["malformed"] += 1
        errors.extend(new_errors)

    stopped_early = False
    sources = _sources(path, split)
    try:
        for label, records in sources:
            for row_no, record, parse_error in records:
                counts["read"] += 1
                if isinstance(record, Mapping):
                    seen_columns.update(record)
                    column_seen = column_seen or solve_rate_column in record
                if parse_error is not None:
                    refuse([RowError(row_no, RECORD_FIELD, parse_error, label)])
                    continue
                task, row_errors = parse_row(record, row_no, label, checks=checks)
                if task is None:
                    refuse(row_errors)
                    continue
                try:
                    verdict = _solve_rate_verdict(task, solve_rate_column, solve_rate_range)
                except ValueError as err:
                    refuse([RowError(row_no, str(solve_rate_column), str(err), label)])
                    continue
                counts[verdict] += 1
                if verdict == "kept":
                    rows.append(task)
                    if limit is not None and len(rows) >= limit:
                        stopped_early = True
                        break
            if stopped_early:
                break
    finally:
        for _, records in sources:  # release open files of partly read sources
            getattr(records, "close", lambda: None)()

    # After an early stop the column may simply not have come up yet.
    if not column_seen and counts["read"] > 0 and not stopped_early:
        raise ValueError(
            f"solve-rate column {solve_rate_column!r} is not in any row of {path}; "
            f"columns present: {sorted(seen_columns)}"
        )
    if counts["malformed"] > LOG_ERRORS_LIMIT:
        logger.warning(
            "... and %d more malformed rows not logged individually",
            counts["malformed"] - LOG_ERRORS_LIMIT,
        )
    if errors and on_malformed == "error":
        shown = "\n  ".join(str(e) for e in errors[:RAISE_ERRORS_LIMIT])
        more = len(errors) - RAISE_ERRORS_LIMIT
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise ValueError(
            f"{counts['malformed']} malformed row(s) in {path} ({len(errors)} problem(s)):"
            f"\n  {shown}{tail}\nFix these rows, or pass on_malformed='skip' to drop them."
        )

    result = LoadResult(rows=rows, errors=errors, counts=counts, source=str(path))
    logger.info(result.summary())
    unknown = sorted(set(result.task_type_counts()) - set(checks or ()))
    if checks is not None and unknown:
        logger.warning(
            "kept rows with task types %s that have no known verifier shape; "
            "scoring will refuse them unless a verifier is registered",
            unknown,
        )
    return result


def write_jsonl(rows: Iterable[TaskRow | Mapping[str, Any]], path: str | os.PathLike[str]) -> int:
    """Write rows as JSON Lines that ``load_tasks`` reads back; return how many.

    Dicts are validated first, so a generator bug fails here, next to its
    cause, instead of as malformed rows at training time. The file is written
    to a temporary name and renamed, so a crash never leaves half a file.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for index, row in enumerate(rows, start=1):
        if not isinstance(row, TaskRow):
            task, row_errors = parse_row(row, index)
            if task is None:
                problems = "; ".join(str(e) for e in row_errors)
                raise ValueError(f"refusing to write invalid task to {target}: {problems}")
            row = task
        lines.append(json.dumps(row.model_dump(), ensure_ascii=False))
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.writelines(line + "\n" for line in lines)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return len(lines)
