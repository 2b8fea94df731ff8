"""``factored_norm``: the DoRA row norm ``||W + s B A||`` without forming ``B @ A`` (derivation: docs/math.md).

Also ``dora_scales``: ``g = m / norm`` and friends for a layer, kept for as long as its weights are unchanged (the
norm never depends on the input; see ``NormCache``), behind the custom op ``flashdora::dora_scales``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from flashdora import _checks, backend
from flashdora.ops import norm_group

# Default transient budget of the eager path: 16 Mi fp32 elements (64 MiB) per chunk.
_CHUNK_ELEMENTS = 16 * 1024 * 1024
_HALF = (torch.float16, torch.bfloat16)


def default_chunk_size(d_in: int, r: int) -> int:
    """Rows per chunk that keep one ``[rows, max(d_in, r)]`` fp32 transient under ~64 MiB."""
    return max(1, _CHUNK_ELEMENTS // max(d_in, r))


def factored_norm(weight, lora_A, lora_B, scaling, *, chunk_size=None) -> torch.Tensor:
    """Row norms of ``W + s B A`` from ``||W||^2 + 2s <W A^T, B>_row + s^2 <B (A A^T), B>_row``.

    Never forms ``B @ A``. The eager path walks ``chunk_size`` rows at a time, accumulating in float32, so that no
    intermediate holds more than ``chunk_size * max(d_in, r)`` elements (besides a cast copy of ``lora_A`` when its
    dtype differs from ``weight``'s). With 16-bit ``weight`` the cross-term GEMM runs on 16-bit operands (tensor
    cores on the GPU) with ``lora_A`` cast to ``weight``'s dtype; float32 weights keep float32 operands. When
    ``r >= d_in`` the factored terms are larger than the dense row chunk, so each chunk forms ``W_c + s B_c A`` for
    its own rows instead. Tiny negative round-off is clamped to 0 before the square root. On CUDA tensors the
    fused Triton kernel computes the same sum (``FLASHDORA_BACKEND``); ``chunk_size`` applies to the eager path.

    The result carries no autograd history: DoRA treats the norm as a constant (paper, sec. 4.3).

    Args:
        weight: ``[d_out, d_in]`` base weight (any strides, e.g. the transpose of a ``Conv1D`` weight).
        lora_A: ``[r, d_in]``.
        lora_B: ``[d_out, r]``.
        scaling: finite real ``s``.
        chunk_size: rows per chunk of the eager path; default keeps each transient under ~64 MiB.

    Returns:
        ``[d_out]`` float32 tensor on ``weight``'s device (float64 when an input is float64, for references).

    Raises:
        TypeError: a non-tensor or non-floating argument, or a non-number ``scaling``.
        ValueError: mismatched shapes or devices, non-finite ``scaling``, ``chunk_size < 1``.
    """
    fn = "factored_norm"
    _checks.lora_pair(fn, weight, lora_A, lora_B)
    scaling = _checks.scaling(fn, scaling)
    if chunk_size is not None:
        chunk_size = _checks.positive_int(fn, "chunk_size", chunk_size)
    return compute_norm(weight.detach(), lora_A.detach(), lora_B.detach(), scaling, chunk_size)


@torch.no_grad()
def compute_norm(weight, lora_A, lora_B, scaling: float, chunk_size: int | None = None, w_sq=None) -> torch.Tensor:
    """The validated core: one norm computation on the backend's path, counted as ``norm:<path>``.

    Autocast is off inside: the eager path's fp32 matmuls (``A A^T``, ``(B A A^T)``) would otherwise run in 16 bits.
    """
    if backend.use_triton(weight, lora_A, lora_B):
        from flashdora.kernels.norm import factored_norm_sq

        backend.count("norm:triton")
        sq = factored_norm_sq(weight, lora_A, lora_B, scaling, w_sq)
    else:
        backend.count("norm:eager")
        with backend.autocast_off(weight.device.type):
            sq = norm_sq_eager(weight, lora_A, lora_B, scaling, chunk_size, w_sq)
    return sq.clamp_min_(0.0).sqrt_()


def weight_sq_eager(weight, chunk_size: int | None = None) -> torch.Tensor:
    """``||W||^2`` per row, float32 accumulation (float64 for float64 weights), chunked like the norm."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    chunk = chunk_size or default_chunk_size(weight.shape[1], 1)
    parts = [torch.linalg.vector_norm(weight[i : i + chunk], dim=1, dtype=acc) for i in range(0, len(weight), chunk)]
    return torch.cat(parts).square_()


def norm_sq_eager(weight, lora_A, lora_B, scaling: float, chunk_size: int | None = None, w_sq=None) -> torch.Tensor:
    """Chunked float32-accumulating ``||W + s B A||^2`` per row, in plain torch; ``w_sq``: a known ``||W||^2``."""
    d_out, d_in = weight.shape
    r = lora_A.shape[0]
    chunk = chunk_size or default_chunk_size(d_in, r)
    acc = torch.float64 if torch.float64 in (weight.dtype, lora_A.dtype, lora_B.dtype) else torch.float32
    out = torch.empty(d_out, dtype=acc, device=weight.device)
    a_acc = lora_A.to(acc)
    if r >= d_in:
        for i in range(0, d_out, chunk):
            rows = torch.addmm(weight[i : i + chunk].to(acc), lora_B[i : i + chunk].to(acc), a_acc, alpha=scaling)
            out[i : i + chunk] = torch.linalg.vector_norm(rows, dim=1).square_()
        return out
    mm_dtype = weight.dtype if weight.dtype in _HALF else acc
    a_mm = lora_A.to(mm_dtype)  # [r, d_in]
    gram = a_acc @ a_acc.T  # [r, r]
    for i in range(0, d_out, chunk):
        w = weight[i : i + chunk].to(mm_dtype)  # [c, d_in], a no-op unless weight is float32 beside float64
        b = lora_B[i : i + chunk].to(acc)  # [c, r]
        if w_sq is None:
            sq = torch.linalg.vector_norm(w, dim=1, dtype=acc).square_()
        else:
            sq = w_sq[i : i + chunk].to(acc, copy=True)
        cross = (w @ a_mm.T).to(acc)  # [c, r]
        sq += (2.0 * scaling) * (cross * b).sum(1)
        sq += (scaling * scaling) * ((b @ gram) * b).sum(1)
        out[i : i + chunk] = sq
    return out


def scales(magnitude: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``[3, d_out]``: rows ``g = m / norm``, ``g - 1 = (m - norm) / norm`` and ``1 / norm``, in float32.

    (float64 for float64 inputs.) A row with ``norm == 0`` (its W row and LoRA delta are both zero) gets ``g = 0``,
    ``g - 1 = -1`` and ``1 / norm = 0``: it outputs its bias and gets a zero magnitude gradient, never NaN.
    """
    acc = torch.promote_types(magnitude.dtype, torch.float32)
    m, n = magnitude.detach().to(acc), norm.detach().to(acc)
    positive = n > 0
    inv = torch.where(positive, 1.0 / n, torch.zeros_like(n))
    gm1 = torch.where(positive, (m - n) * inv, torch.full_like(n, -1.0))
    return torch.stack([m * inv, gm1, inv])


def _scales(magnitude, norm, triton: bool) -> torch.Tensor:
    if triton:
        from flashdora.kernels.norm import scales_from_norm

        return scales_from_norm(magnitude, norm)
    return scales(magnitude, norm)


@torch.no_grad()
def _fresh(weight, lora_A, lora_B, magnitude, scaling, triton: bool, w_sq=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A newly computed ``(norm, scales)``; on the Triton path the norm's finish and the scales are one launch."""
    if triton:
        from flashdora.kernels.norm import norm_and_scales

        backend.count("norm:triton")
        return norm_and_scales(weight, lora_A, lora_B, scaling, magnitude, w_sq=w_sq)
    norm = compute_norm(weight, lora_A, lora_B, scaling, w_sq=w_sq)
    return norm, scales(magnitude, norm)


def cache_enabled() -> bool:
    """``FLASHDORA_NORM_CACHE`` (default on); ``0``, ``false`` or ``off`` turns the norm cache off everywhere."""
    return backend.switch("FLASHDORA_NORM_CACHE", True)


_set_grad_enabled = torch._C._set_grad_enabled

_storage_numbers = itertools.count(1)


def _storage_number(t) -> int:
    """A number for ``t``'s storage, never given to another storage in this process.

    ``p.data = new`` swaps a parameter's storage without moving its version counter, and the allocator may put the
    new storage where the old one was: PEFT's DoRA unmerge does (``new = W / f - delta``), so ``data_ptr`` and the
    version alone took the unmerged weight, a few float32 ulps off the original, for the original. torch keeps one
    Python object per live storage, attributes included, so the number lives exactly as long as the storage.
    """
    s = t.untyped_storage()
    n = getattr(s, "_flashdora_number", None)
    if n is None:
        n = s._flashdora_number = next(_storage_numbers)
    return n


def _tensor_keys(w, a, b, m) -> tuple:
    """The cache key of each of a layer's four tensors, written out in one call (this runs on every layer call):
    ``(where, storage number, version)``, with ``where`` the address, shape, strides, dtype and device.

    The version counter moves on every in-place write through autograd-visible aliases (load_state_dict, copy_
    under no_grad, for-loop and foreach optimizers); the storage number moves when storage is swapped (`.data =`,
    `.to()`), even into the old address; data_ptr tells views of one storage apart.
    """
    n = _storage_number
    return (
        ((w.data_ptr(), w.shape, w.stride(), w.dtype, w.device), n(w), w._version),
        ((a.data_ptr(), a.shape, a.stride(), a.dtype, a.device), n(a), a._version),
        ((b.data_ptr(), b.shape, b.stride(), b.dtype, b.device), n(b), b._version),
        ((m.data_ptr(), m.shape, m.stride(), m.dtype, m.device), n(m), m._version),
    )


def _storage(keys: tuple, scaling: float, w_sq) -> tuple:
    """Where a norm graph reads its inputs: the ``where`` part of the four ``keys`` (never their version counters or
    storage numbers: new values, or a new storage, at the same address are what a graph replay reads), ``scaling``
    and the ``||W||^2`` buffer's address."""
    return (keys[0][0], keys[1][0], keys[2][0], keys[3][0], scaling, w_sq.data_ptr())


_optimizer_steps = 0
_hook_handle = None


def _optimizer_steps_now() -> int:
    return _optimizer_steps


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizers() -> None:
    """Count every ``torch.optim`` step in the process: fused optimizers (HF Trainer's default ``adamw_torch_fused``)
    write parameters without moving their version counters, so the cache key carries this count too."""
    global _hook_handle
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _hook_handle = register_optimizer_step_post_hook(_count_optimizer_step)


class _Entries(dict):
    """One layer's cache entries. Copies and pickles of a model start empty: the entries describe this model's
    storage (and hold CUDA graphs, which cannot be copied)."""

    def __deepcopy__(self, memo):
        return _Entries()

    def __reduce__(self):
        return _Entries, ()


def graphs_enabled() -> bool:
    """``FLASHDORA_NORM_GRAPH`` (default on): replay each layer's norm computation as a CUDA graph."""
    return backend.switch("FLASHDORA_NORM_GRAPH", True)


def _graphable(weight) -> bool:
    """CUDA graphs for this layer's norm: CUDA tensors (the Triton path also runs on CPU ones, interpreted) and
    ``FLASHDORA_NORM_GRAPH`` on."""
    return weight.is_cuda and graphs_enabled()


_MAX_CAPTURES = 3  # per layer: storage that keeps moving (e.g. parameters gathered into new buffers) stops capturing


def _fresh_graphed(cache: dict, storage: tuple, weight, lora_A, lora_B, magnitude, scaling, w_sq):
    """``_fresh`` on the Triton path, replayed from a per-layer CUDA graph once one is captured for this storage.

    A graph re-reads its inputs where they were at capture, so it is keyed on ``storage`` (``_storage``: addresses,
    shapes, strides, dtypes and devices, never version counters: new values in the same storage are what it is for)
    and ``scaling``. The first computation for a storage runs eagerly (and warms the autotuner); it is captured for
    the next. A replay hands out views of the graph's own buffer (made once, at capture), which the next replay
    rewrites; while a result handed out earlier is still held (a pending backward saved it), the computation runs
    eagerly instead.
    """
    entry = cache.get("graph")
    if entry is not None and entry[0] == storage:
        for name in ("norm", "scales", "norm_key", "scales_key"):  # our earlier results: a replay rewrites them
            cache.pop(name, None)
        views = entry[1]()
        if views is None:  # an earlier result is still held: this one is computed apart, the graph kept
            return _fresh(weight, lora_A, lora_B, magnitude, scaling, True, w_sq)
        backend.count("norm:triton")
        return views
    fresh = _fresh(weight, lora_A, lora_B, magnitude, scaling, True, w_sq)
    captures = cache.get("graph_captures", 0)
    if _graphable(weight) and captures < _MAX_CAPTURES and not torch.cuda.is_current_stream_capturing():
        cache["graph_captures"] = captures + 1
        cache.pop("graph", None)
        from flashdora.kernels.norm import NormGraph

        try:
            cache["graph"] = (storage, NormGraph(weight, lora_A, lora_B, scaling, magnitude, w_sq))
        except Exception as e:  # noqa: BLE001 - a capture failure costs speed, never correctness
            cache["graph_captures"] = _MAX_CAPTURES
            backend.warn_once("norm_graph", f"flashdora: norm CUDA graph capture failed, running eagerly ({e})")
    return fresh


class NormCache:
    """Per-layer storage, O(d_out): the norm, ``||W||^2`` and the scales, each with the key it was made for.

    Entries live on an owner object (PEFT's per-adapter ``DoraLinearLayer``) and die with it; the ops find them
    by ``id(owner)``. Keys: address, storage number (``_storage_number``), version counter, shape, strides, dtype
    and device of W, A, B and the magnitude, ``scaling``, and the number of ``torch.optim`` steps taken in the
    process (any optimizer's step invalidates every entry). Writes outside autograd and ``torch.optim``
    (``p.data.copy_(...)`` by hand) are not seen: call ``flashdora.enable(model)`` again after such edits (it clears
    the cache), or set ``FLASHDORA_NORM_CACHE=0``.
    """

    _owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    @classmethod
    def register(cls, owner) -> int:
        _watch_optimizers()
        cls._owners[id(owner)] = owner
        return id(owner)

    @classmethod
    def lookup(cls, weight, lora_A, lora_B, magnitude, scaling: float, cache_id: int) -> torch.Tensor:
        """``scales(magnitude, norm)`` for this layer, recomputing only what its weights' versions invalidate."""
        owner = cls._owners.get(cache_id) if cache_id >= 0 else None
        return cls.lookup_owner(weight, lora_A, lora_B, magnitude, scaling, owner)

    @classmethod
    def lookup_owner(cls, weight, lora_A, lora_B, magnitude, scaling: float, owner) -> torch.Tensor:
        """``lookup`` by the owner object itself (``None``: no cache), as eager calls hold it."""
        if owner is None or not cache_enabled():  # (``_fresh`` runs under no_grad)
            triton = backend.use_triton(weight, lora_A, lora_B, magnitude)
            return _fresh(weight, lora_A, lora_B, magnitude, scaling, triton)[1]
        cache = owner.__dict__.get("_flashdora_cache")
        if cache is None:
            cache = owner.__dict__["_flashdora_cache"] = _Entries()
        w_key, a_key, b_key, m_key = _tensor_keys(weight, lora_A, lora_B, magnitude)
        key = (w_key, a_key, b_key, scaling, _optimizer_steps)
        full_key = (key, m_key)
        if cache.get("scales_key") == full_key:
            backend.count("norm:cached")
            return cache["scales"]
        # The inputs may be parameters (eager calls skip the detach): nothing to record. (torch.no_grad's context
        # manager costs several times this toggle, on every miss.)
        grad = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            return cls._update(cache, key, full_key, weight, lora_A, lora_B, magnitude, scaling, owner)
        finally:
            _set_grad_enabled(grad)

    @staticmethod
    def _update(cache, key, full_key, weight, lora_A, lora_B, magnitude, scaling, owner):
        triton = backend.use_triton(weight, lora_A, lora_B, magnitude)
        if cache.get("norm_key") == key:
            backend.count("norm:cached")
            cache["scales"] = _scales(magnitude, cache["norm"], triton)
        else:
            w_sq = NormCache._weight_sq(cache, key[0], weight, triton)
            if triton:  # the norm group's run (every training layer at once), else this layer alone
                grouped = norm_group.enabled()
                fresh = norm_group.recompute(owner, weight) if grouped else None
                if fresh is None:
                    storage = _storage((*key[:3], full_key[1]), scaling, w_sq)
                    fresh = _fresh_graphed(cache, storage, weight, lora_A, lora_B, magnitude, scaling, w_sq)
                    if grouped:
                        norm_group.note(owner, cache, weight, lora_A, lora_B, magnitude, scaling, storage)
            else:
                fresh = _fresh(weight, lora_A, lora_B, magnitude, scaling, triton, w_sq)
            cache["norm"], cache["scales"] = fresh
            cache["norm_key"] = key
        cache["scales_key"] = full_key
        return cache["scales"]

    @staticmethod
    def _weight_sq(cache, w_key: tuple, weight, triton: bool) -> torch.Tensor:
        """``||W||^2``, computed once per version of W (a frozen base: once). Kept in one buffer, rewritten in place
        when W changes, so a norm CUDA graph that reads it stays valid."""
        buf = cache.get("w_sq")
        if cache.get("w_sq_key") == w_key and buf is not None:
            return buf
        if triton:
            from flashdora.kernels.norm_gemm import weight_sq

            fresh = weight_sq(weight)
        else:
            fresh = weight_sq_eager(weight)
        if buf is not None and buf.shape == fresh.shape and buf.dtype == fresh.dtype and buf.device == fresh.device:
            fresh = buf.copy_(fresh)
        cache["w_sq_key"], cache["w_sq"] = w_key, fresh
        return fresh

    @staticmethod
    def clear(owner) -> None:
        owner.__dict__.pop("_flashdora_cache", None)


@torch.library.custom_op("flashdora::dora_scales", mutates_args=())
def dora_scales_op(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, magnitude: torch.Tensor, scaling: float,
    cache_id: int,
) -> torch.Tensor:  # fmt: skip
    """``scales(magnitude, ||W + s B A||_row)``, from the layer's cache when ``cache_id`` names a registered owner."""
    return NormCache.lookup(weight, lora_A, lora_B, magnitude, scaling, cache_id).clone()  # no alias of the cache


@dora_scales_op.register_fake
def _(weight, lora_A, lora_B, magnitude, scaling, cache_id):
    return magnitude.new_empty((3, weight.shape[0]), dtype=torch.promote_types(magnitude.dtype, torch.float32))


def dora_scales(weight, lora_A, lora_B, magnitude, scaling: float, cache_id: int = -1) -> torch.Tensor:
    """The ``[3, d_out]`` scales ``(g, g - 1, 1 / norm)`` of a DoRA layer (detached; see ``scales``).

    Eager calls go straight to the cache (no op-dispatch overhead); under ``torch.compile`` the custom op keeps
    the cache lookup at run time, opaque to the graph.
    """
    if torch.compiler.is_compiling():
        return dora_scales_op(weight.detach(), lora_A.detach(), lora_B.detach(), magnitude.detach(), scaling, cache_id)
    return NormCache.lookup(weight, lora_A, lora_B, magnitude, scaling, cache_id)  # no_grad inside where it computes
