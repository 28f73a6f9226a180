"""One logged step's measurements: the record ``metrics.jsonl`` holds, one JSON object a line.

The loop writes ``MetricsRecord``s; the run summary, the sweep and the benchmarks read them
back through ``read_metrics``, so a field is named in one place. Records of evaluation steps
also carry ``val_loss``, ``val_ppl``, ``val_tokens`` and, for a mixture, ``val_loss/NAME``
per source; the other records leave them out.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from yatrain.common import dumps_json
from yatrain.errors import ConfigError
from yatrain.files import RecordFile

_VAL_SOURCE = "val_loss/"  # prefix of a mixture source's held-out loss in the JSON record
_NOT_NUMBERS = ("step", "val_sources")  # checked on their own


@dataclass(frozen=True)
class MetricsRecord:
    """What one logging window measured (throughput figures are window averages)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_seen: int
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float
    peak_memory_bytes: int | None  # None where the platform offers no reading
    data_wait_frac: float  # share of the window spent waiting for batches
    comm_bytes_sent: int  # bytes this rank sent in collectives so far (the two below)
    skipped_steps: int  # non-finite steps skipped so far
    # Peak bytes of live tensors in the window (what the planner predicts): the CUDA
    # allocator's figure on GPU; on CPU the live-tensor tracker's, on the one step it
    # watched (None on other records).
    peak_tensor_bytes: int | None = None
    # Of comm_bytes_sent: within this rank's shard group, and across groups (hybrid sharding's
    # gradient all-reduce between replicas; 0 under full sharding).
    comm_bytes_sent_intra: int = 0
    comm_bytes_sent_cross: int = 0
    # The step time by part, seconds per step (train.timing): compute, communication the
    # compute waited on, data wait, optimizer, and what no timer covers. Checkpoint saves
    # and evaluations are outside the step time: their seconds in this window, beside it.
    compute_s: float | None = None
    comm_exposed_s: float | None = None
    data_wait_s: float | None = None
    optimizer_s: float | None = None
    unattributed_s: float | None = None
    checkpoint_s: float | None = None
    eval_s: float | None = None
    # Stragglers (runtime.stragglers): the rank with the longest busy time per step (the step
    # minus its waits on collectives and data), that time, and the median over ranks.
    slowest_rank: int | None = None
    slowest_busy_s: float | None = None
    median_busy_s: float | None = None
    val_loss: float | None = None  # held-out loss, at evaluation steps only
    val_ppl: float | None = None  # exp(val_loss)
    val_tokens: int | None = None  # predicted tokens the evaluation covered
    val_sources: dict[str, float] = field(default_factory=dict)  # a mixture: loss per source

    @classmethod
    def measure(
        cls,
        *,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens_per_step: int,
        window_s: float,
        window_steps: int,
        world_size: int,
        flops_per_token: float,
        peak_flops: float,
        peak_memory: int | None,
        data_wait_s: float,
        bytes_sent: tuple[int, int],
        skipped_steps: int,
        peak_tensors: int | None = None,
        val: dict | None = None,
        breakdown: dict | None = None,
    ) -> MetricsRecord:
        """The record of a window of ``window_steps`` steps that took ``window_s`` seconds;
        ``val``: an evaluation's fields (``Evaluation.record_fields``); ``bytes_sent``:
        (within the shard group, across groups) so far; ``breakdown``: the step-time and
        straggler fields."""
        tokens_per_s = window_steps * tokens_per_step / window_s
        per_device = tokens_per_s / world_size
        return cls(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_seen=step * tokens_per_step,
            step_time_s=window_s / window_steps,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_device=per_device,
            tflops_per_device=per_device * flops_per_token / 1e12,
            mfu=per_device * flops_per_token / peak_flops,
            peak_memory_bytes=peak_memory,
            data_wait_frac=data_wait_s / window_s,
            comm_bytes_sent=sum(bytes_sent),
            skipped_steps=skipped_steps,
            peak_tensor_bytes=peak_tensors,
            comm_bytes_sent_intra=bytes_sent[0],
            comm_bytes_sent_cross=bytes_sent[1],
            **(val or {}),
            **(breakdown or {}),
        )

    def to_json(self) -> dict:
        """The JSON object: evaluation fields only at evaluation steps, a mixture's sources
        flattened to ``val_loss/NAME``."""
        data = dataclasses.asdict(self)
        sources = data.pop("val_sources")
        if self.val_loss is None:
            for name in ("val_loss", "val_ppl", "val_tokens"):
                del data[name]
        data.update({f"{_VAL_SOURCE}{name}": loss for name, loss in sources.items()})
        return data

    @classmethod
    def from_json(cls, data: dict) -> MetricsRecord:
        """A record from one parsed line; fields this version does not know are ignored,
        fields an older version did not write are None, and ``null`` floats (written for
        NaN and inf) read back as NaN."""
        values = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        values["val_sources"] = {
            k.removeprefix(_VAL_SOURCE): v for k, v in data.items() if k.startswith(_VAL_SOURCE)
        }
        for name in _FLOAT_FIELDS:
            if values[name] is None:
                values[name] = math.nan
        return cls(**values)


_FLOAT_FIELDS = [f.name for f in dataclasses.fields(MetricsRecord) if f.type == "float"]
_NUMBER_FIELDS = [f.name for f in dataclasses.fields(MetricsRecord) if f.name not in _NOT_NUMBERS]


def parse_record(line: bytes | str) -> MetricsRecord:
    """One line of ``metrics.jsonl`` as a record; ValueError (saying why) for anything that
    is not one: bytes that are not UTF-8, not JSON, not an object, a ``step`` that is not
    a whole number, a field that is not a finite number, a step time that is not positive."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        data = json.loads(text)
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8 text") from None
    except RecursionError:
        raise ValueError("it is nested too deeply") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"it is not JSON ({error.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"it is a JSON {type(data).__name__}, not an object")
    step = data.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"its step {step!r} is not a whole number")
    for name in [*_NUMBER_FIELDS, *(k for k in data if k.startswith(_VAL_SOURCE))]:
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"its {name} {value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"its {name} {value!r} is not finite")
    if data.get("step_time_s", 1) is not None and not data.get("step_time_s", 1) > 0:
        raise ValueError(f"its step_time_s {data['step_time_s']!r} is not positive")
    return MetricsRecord.from_json(data)


def read_metrics(path: Path) -> list[MetricsRecord]:
    """Every record of a ``metrics.jsonl`` file, in order; a line that is not a record is
    one ConfigError naming it (a last line with no newline yet, being written, is left out)."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(parse_record(line))
        except ValueError as reason:
            if number == len(lines) and not data.endswith(b"\n"):
                break  # being written right now
            raise ConfigError(
                f"{path} line {number} is not a metrics record: {reason}; the file is "
                "damaged: remove that line, or pass another run"
            ) from None
    return records


def steady_means(records: Sequence[MetricsRecord], fields: Sequence[str]) -> dict[str, float]:
    """The mean of each field over ``records`` (callers leave out warm-up steps first)."""
    return {name: sum(getattr(r, name) for r in records) / len(records) for name in fields}


def largest_tensor_peak(records: Sequence[MetricsRecord]) -> int | None:
    """The highest live-tensor peak among ``records``, None if none was measured."""
    readings = [r.peak_tensor_bytes for r in records if r.peak_tensor_bytes is not None]
    return max(readings) if readings else None


def largest_peak_memory(records: Sequence[MetricsRecord]) -> int | None:
    """The highest peak-memory reading among ``records``, None if none was measured."""
    readings = [r.peak_memory_bytes for r in records if r.peak_memory_bytes is not None]
    return max(readings) if readings else None


class MetricsFile:
    """``metrics.jsonl``, each record appended whole (a torn tail is cut on open)."""

    def __init__(self, path: Path) -> None:
        self.file = RecordFile(path)

    def write(self, record: MetricsRecord) -> None:
        self.file.append(dumps_json(record.to_json()))  # null, never a bare NaN

    def close(self) -> None:
        self.file.close()
