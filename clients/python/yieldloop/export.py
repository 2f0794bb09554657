"""Exporting a job's runs: OpenAI-RFT-style JSONL and a token-level format (JSONL or Parquet).

- ``rft`` (JSONL): one ``{"prompt", "completion", "reward"}`` object per graded run (plus ``trace_id`` and
  ``group_id``), the completion being the model's text of every turn.
- ``tokens`` (JSONL or Parquet): per graded run the full token sequence of its last turn (``token_ids``),
  the sampling ``logprobs`` (0 on tokens the model did not sample), ``mask`` (1 on the model's own tokens),
  ``reward``, ``group_id``, ``trace_id``, ``run_id`` and the ``weight_versions`` that sampled its turns.

Runs that did not finish graded (environment or infrastructure errors) carry no reward and are left out.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from typing import Any

from yieldloop.errors import FailedPreconditionError, InvalidArgumentError
from yieldloop.groups import stitch_turns
from yieldloop.types import Run, RunStatus

FORMATS = ("jsonl", "parquet")
KINDS = ("rft", "tokens")


def rft_row(run: Run) -> dict[str, Any]:
    return {
        "prompt": run.prompt,
        "completion": "".join(turn.completion_text for turn in run.turns),
        "reward": run.reward,
        "trace_id": run.trace_id,
        "group_id": run.group_id,
    }


def token_row(run: Run) -> dict[str, Any]:
    tokens, logprobs, is_action = stitch_turns(run.turns, f"run {run.run_id}")
    return {
        "trace_id": run.trace_id,
        "run_id": run.run_id,
        "group_id": run.group_id,
        "reward": run.reward,
        "token_ids": tokens,
        "logprobs": logprobs,
        "mask": [int(a) for a in is_action],
        "weight_versions": [turn.weight_version for turn in run.turns],
    }


def export_runs(runs: Iterable[Run], path: str | pathlib.Path, fmt: str = "jsonl", kind: str = "") -> int:
    """Writes the graded runs to ``path``; returns how many were written."""
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"unknown format {fmt!r} (use {' or '.join(FORMATS)})", reason="INVALID_FIELD")
    kind = kind or ("rft" if fmt == "jsonl" else "tokens")
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown kind {kind!r} (use {' or '.join(KINDS)})", reason="INVALID_FIELD")
    make = rft_row if kind == "rft" else token_row
    rows = [make(run) for run in runs if run.status == RunStatus.GRADED]
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise FailedPreconditionError(
                "Parquet export needs pyarrow: pip install 'yieldloop[parquet]'", reason="MISSING_DEPENDENCY"
            ) from None

        schema = None
        if kind == "tokens":
            schema = pa.schema(
                [
                    ("trace_id", pa.string()),
                    ("run_id", pa.string()),
                    ("group_id", pa.string()),
                    ("reward", pa.float64()),
                    ("token_ids", pa.list_(pa.int32())),
                    ("logprobs", pa.list_(pa.float32())),
                    ("mask", pa.list_(pa.int8())),
                    ("weight_versions", pa.list_(pa.string())),
                ]
            )
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return len(rows)


def read_export(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Reads an export back (JSONL or Parquet) as a list of rows."""
    path = pathlib.Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
