"""The one benchmark timer: warm-up, then the median of N timed calls, and peak memory above a recorded baseline.

On CUDA each call is bracketed by CUDA events (GPU time, launch gaps included); elsewhere by ``time.perf_counter``
after a synchronize, so the same code runs in CPU tests. Peak memory is ``torch.cuda.max_memory_allocated`` over
the timed calls minus ``torch.cuda.memory_allocated`` just before them; ``None`` off CUDA.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIB = 2**20
GIB = 2**30


@dataclass
class Measurement:
    """Median and all timings of one benchmarked callable, and its peak memory above the baseline."""

    ms: float
    times_ms: list[float]
    peak_extra_bytes: int | None
    warmup_s: float = 0.0  # wall time of the warm-up calls (compiles and autotuning fall here)

    @property
    def peak_extra_mib(self) -> float | None:
        return None if self.peak_extra_bytes is None else self.peak_extra_bytes / MIB

    @property
    def peak_extra_gib(self) -> float | None:
        return None if self.peak_extra_bytes is None else self.peak_extra_bytes / GIB


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: torch.device | str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory(device: torch.device | str) -> None:
    """Drop unreachable objects and return cached blocks, so the next baseline starts clean."""
    gc.collect()
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def describe_error(e: BaseException) -> str:
    """What a failed benchmark row records: ``out of memory``, else the exception's type and message (300 chars)."""
    return "out of memory" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"[:300]


def _time_calls(fn: Callable[[], object], reps: int, device: torch.device | str) -> list[float]:
    """Milliseconds of ``reps`` calls of ``fn`` (results are dropped at once, so they never pile up)."""
    if is_cuda(device):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_interleaved(
    fns: dict[str, Callable[[], object]], *, reps: int, device, peaks: dict[str, float] | None = None
) -> dict[str, list[float]]:
    """Milliseconds of ``reps`` calls of each of ``fns``, taken call by call: timed step ``k`` runs every callable
    once, starting with the ``k``-th (the start rotates; the cyclic order, and so which callable runs right before
    which, is ``fns``' own). A change of the host's load between steps then hits every callable alike, where timing
    each one's calls in a block of its own lets it land on one of them. But no callable runs right after itself, as
    a model's layers do: its host code and data start colder. No warm-up here; results are
    dropped at once.

    ``peaks`` (CUDA only): filled with each callable's largest peak over its calls, in GiB above what was allocated
    right before the call (read outside the timed span: the allocator's statistics move when the host issues work).
    """
    if reps < 1:
        raise ValueError(f"measure_interleaved: reps expected >= 1, got {reps}")
    names = list(fns)
    calls = [names[(k + i) % len(names)] for k in range(reps) for i in range(len(names))]  # step k, in turn
    times: dict[str, list[float]] = {name: [] for name in names}
    if not is_cuda(device):
        for name in calls:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
        return times
    synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in calls]
    for name, (start, end) in zip(calls, events):
        if peaks is not None:
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start.record()
        fns[name]()
        end.record()
        if peaks is not None:
            extra = max(0, torch.cuda.max_memory_allocated(device) - before) / GIB
            peaks[name] = max(peaks.get(name, 0.0), extra)
    torch.cuda.synchronize(device)
    for name, (start, end) in zip(calls, events):
        times[name].append(start.elapsed_time(end))
    return times


def measure(fn: Callable[[], object], *, warmup: int, reps: int, device: torch.device | str) -> Measurement:
    """Run ``fn`` ``warmup`` times, then time ``reps`` calls; median ms and peak memory above the pre-call baseline,
    and the warm-up's wall time (queue drained before and after).

    The baseline is what is allocated after the warm-up (the resident model, inputs and anything ``fn`` keeps, such
    as ``.grad`` buffers unless ``fn`` sets them to ``None``), so the peak is the transient cost of one call.
    """
    if reps < 1:
        raise ValueError(f"measure: reps expected >= 1, got {reps}")
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    synchronize(device)
    warmup_s = time.perf_counter() - t0
    baseline = None
    if is_cuda(device):
        gc.collect()
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = _time_calls(fn, reps, device)
    peak = None
    if baseline is not None:
        peak = max(0, torch.cuda.max_memory_allocated(device) - baseline)
    return Measurement(ms=statistics.median(times), times_ms=times, peak_extra_bytes=peak, warmup_s=warmup_s)


def pool_rounds(rounds: list[dict], peak_key: str) -> dict:
    """One row from the same row of several rounds: every timed call pooled (``times_ms``), their median as ``ms``,
    each round's median in ``round_ms``, the largest ``peak_key``, every path taken; the first round's other fields.
    A round that failed (``ms`` is ``None``) gives its row, error included."""
    failed = [r for r in rounds if r.get("ms") is None]
    if failed:
        return failed[0]
    times = [t for r in rounds for t in r["times_ms"]]
    peaks = [r[peak_key] for r in rounds if r[peak_key] is not None]
    return {
        **rounds[0],
        "ms": statistics.median(times),
        "times_ms": times,
        "round_ms": [r["ms"] for r in rounds],
        peak_key: max(peaks) if peaks else None,
        "paths": sorted({p for r in rounds for p in r["paths"]}),
    }


def copy_bandwidth_gbps(device: torch.device | str, *, nbytes: int = GIB, warmup: int = 3, reps: int = 20) -> float:
    """Device-to-device copy rate in GB/s (10^9 bytes, counting bytes read + written) of one ``nbytes`` buffer."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), warmup=warmup, reps=reps, device=device)
    return 2 * nbytes / (m.ms * 1e-3) / 1e9


def gemm_tflops(device: torch.device | str, *, n: int = 8192, dtype=torch.bfloat16, warmup: int = 3, reps: int = 20):
    """Rate of one ``[n, n] @ [n, n]`` matmul in ``dtype``, in TFLOP/s (``2 n^3`` FLOPs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    m = measure(lambda: torch.matmul(a, b, out=out), warmup=warmup, reps=reps, device=device)
    return 2 * n**3 / (m.ms * 1e-3) / 1e12


def host_and_wall(step: Callable[[], object], n: int, device: torch.device | str) -> tuple[float, float]:
    """Medians over ``n`` calls of ``step``, in ms: the host's time to issue it (queue empty at its start) and its
    CUDA-event time. Host time near wall time means the step is bound by the CPU. Off CUDA both are the host's."""
    hosts, walls = [], []
    for _ in range(n):
        if not is_cuda(device):
            t = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t) * 1e3)
            walls.append(hosts[-1])
            continue
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        e0.record()
        step()
        e1.record()
        hosts.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        walls.append(e0.elapsed_time(e1))
    return statistics.median(hosts), statistics.median(walls)
