"""Where the norm cache's CUDA entries may be used: on which streams, and never inside a CUDA graph.

The rules (``ops/norm_cache.py`` applies them; docs/design.md, "The norm cache"):

- An entry is served on the streams it is ordered before: the one it was made on, and those that have since waited
  for it. A hit on another stream makes that stream wait for the producer's work (an event recorded on the producer
  stream at that moment: the entry's kernels and whatever was queued there after them) and marks the entry's tensors
  used by it (``record_stream``), so the caching allocator does not hand their memory out before it is done.
- While a CUDA graph is captured on the current stream, nothing is served and nothing is stored: a graph would bake
  the cached tensor's address into every replay (stale after the next write), and what a capture allocates lives in
  the graph's private pool. The norm is computed inside the graph instead, so each replay recomputes it from the
  weights as they are then (in-place writes keep a parameter's address).
- Under ``torch.compile(mode="reduce-overhead")`` (cudagraph trees) the warm-up runs eagerly with every allocation
  going to the graph pool: an entry made there is memory the trees do not know of ("tensor(s) in the cudagraph pool
  not tracked as outputs"). The compiled op stores nothing while the current stream is the trees' own stream
  (private state of ``torch._inductor.cudagraph_trees``, read only where ``backend.private_apis()``; elsewhere it
  stores nothing whenever cudagraph trees have been imported, since it cannot tell).
"""

from __future__ import annotations

import sys

import torch

from flashdora import backend

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (absent from CPU builds)


def stream_now(device: int) -> int:
    """The current stream of CUDA ``device``, as its handle (``torch.cuda.current_stream(device).cuda_stream``)."""
    if _RAW_STREAM is not None and backend.private_apis():
        return _RAW_STREAM(device)
    return torch.cuda.current_stream(device).cuda_stream


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_current_stream_capturing()


def made_on(t: torch.Tensor) -> tuple[int, set] | tuple[int, None]:
    """``(device, streams)`` for an entry just made from ``t``'s device: the streams it is ordered before (the current
    one; ``None`` on the CPU)."""
    device = t.get_device()
    return device, (None if device < 0 else {stream_now(device)})


def join(device: int, streams: set, tensors) -> None:
    """Order an entry made on ``streams`` before the current stream's work from now on (module docstring)."""
    now = torch.cuda.current_stream(device)
    handle, default = next(iter(streams)), torch.cuda.default_stream(device)
    producer = default if handle == default.cuda_stream else torch.cuda.ExternalStream(handle, device=device)
    now.wait_event(producer.record_event())
    for t in tensors:
        t.record_stream(now)
    streams.add(now.cuda_stream)


def in_tree_pool(device: int) -> bool:
    """Whether CUDA allocations on this thread may go to a cudagraph trees pool (its warm-up or recording)."""
    if capturing():
        return True
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    if not backend.private_apis():
        return True  # cannot tell: store nothing
    try:
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        container = containers.get(device)
        manager = None if container is None else container.tree_manager
        return manager is not None and manager.stream.cuda_stream == stream_now(device)
    except AttributeError:  # a torch whose cudagraph trees keep their state elsewhere
        return True
