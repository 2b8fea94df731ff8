"""The norm group: every training layer's norm recomputed in one go after the weights change (Triton path).

With the norm cache, each DoRA layer recomputes its norm at its first forward after an optimizer step: on
llama3-8b that is 224 lookups a step that miss, each with its own host work (its graph's replay and the
bookkeeping: 100-150 us a layer on the device machines' CPU, ``benchmarks/host_attrib.py``). The group holds the
layers that recomputed since its last run. The first of them to miss after the next change runs the group: one
CUDA graph recomputes every member's norm and scales, and each member's cache files its result under the key its
tensors have at that moment. The other members' lookups then hit.

Membership: a layer joins when it recomputes through its own CUDA graph (its storage is stable). The group is built
once a member misses a second time with no group run in between: a whole step has passed, and every layer that
trains has joined. A group runs only when every member is alive, its tensors sit in the storage the graph reads,
and at least one of its LoRA tensors or magnitude still requires grad. Otherwise it is dropped, every layer goes
back to its own path, and the layers that still recompute form the next group. (An adapter switched off freezes
its parameters, so its layers leave the group.) Elsewhere than CUDA (the Triton interpreter) the group runs its
members' computations one after another: the same bookkeeping, testable on the CPU.
``FLASHDORA_NORM_GROUP=0`` turns the group off.
"""

from __future__ import annotations

import weakref

import torch

from flashdora import backend

_STATES: dict[int, _State] = {}  # by device index (``Tensor.get_device()``: -1 for the CPU)


class _Member:
    __slots__ = ("owner", "tensors", "scaling", "storage", "d_out")

    def __init__(self, owner, tensors, scaling: float, storage: tuple):
        self.owner = weakref.ref(owner)
        self.tensors = tuple(weakref.ref(t) for t in tensors)  # weight, lora_A, lora_B, magnitude
        self.scaling = scaling
        self.storage = storage
        self.d_out = tensors[0].shape[0]

    def trains(self) -> bool:
        """Alive, and at least one of its LoRA tensors or its magnitude requires grad."""
        tensors = [ref() for ref in self.tensors]
        if self.owner() is None or any(t is None for t in tensors):
            return False
        return any(t.requires_grad for t in tensors[1:])


class _State:
    """One device's pending members (in the order they joined) and its group."""

    def __init__(self):
        self.pending: dict[int, _Member] = {}
        self.group: _Group | None = None


def enabled() -> bool:
    return backend.switch("FLASHDORA_NORM_GROUP", True)


def _state(weight: torch.Tensor) -> _State:
    key = weight.get_device()
    st = _STATES.get(key)
    if st is None:
        st = _STATES[key] = _State()
    return st


def recompute(owner, weight) -> tuple | None:
    """``(norm, scales)`` of ``owner``'s layer from a run of its device's group, or ``None`` where no group covers
    it (the caller then recomputes the layer on its own and calls ``note``).

    A candidate's second miss with no group run in between builds the group first, from the earlier group's
    members and every candidate: a whole step has passed since it joined, and every layer that trains has joined.
    """
    st = _STATES.get(weight.get_device())
    if st is None or (st.group is None and len(st.pending) < 2):  # a lone layer: no group to run or build
        return None
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if id(owner) in st.pending or (st.pending and st.group is not None and id(owner) in st.group.index):
        members = [] if st.group is None else [m for m in st.group.members if m.owner() is not None]
        members = [m for m in members if id(m.owner()) not in st.pending] + list(st.pending.values())
        if len(members) < 2:  # a lone layer: no group to build (it stays a candidate, its member kept)
            return None
        st.pending.clear()
        st.group = _Group.build(weight.device, members)
        backend.count("norm:group_build" if st.group is not None else "norm:group_unbuilt")
    group = st.group
    if group is None or id(owner) not in group.index:
        return None
    if not group.run():
        backend.count("norm:group_dropped")
        st.group = None
        return None
    cache = owner.__dict__["_flashdora_cache"]
    return cache["norm"], cache["scales"]


def note(owner, cache: dict, weight, lora_A, lora_B, magnitude, scaling: float, storage: tuple) -> None:
    """``owner``'s layer recomputed on its own: a candidate member, where it trains and its storage is stable (its
    own CUDA graph exists for it; always off CUDA)."""
    if weight.is_cuda and (cache.get("graph") is None or cache["graph"][0] != storage):
        return
    if not (lora_A.requires_grad or lora_B.requires_grad or magnitude.requires_grad):
        return
    st = _state(weight)
    member = st.pending.get(id(owner))
    if member is None or member.storage != storage:
        st.pending[id(owner)] = _Member(owner, (weight, lora_A, lora_B, magnitude), scaling, storage)


def forget(device: torch.device | None = None) -> None:
    """Drop the groups and candidates (of ``device``, or all). Nothing needs this for correctness: a group whose
    member's cache was cleared (``enable`` clears them) fails its next run's checks and is dropped."""
    if device is None:
        _STATES.clear()
    else:
        device = torch.device(device)
        index = device.index if device.type == "cuda" else -1
        _STATES.pop(torch.cuda.current_device() if index is None else index, None)


class _Group:
    """Members' norms and scales written into column ranges of one ``[d_total]`` and one ``[3, d_total]`` buffer,
    by one CUDA graph (on CUDA) or one loop (elsewhere)."""

    def __init__(self, device, members: list[_Member]):
        self.device = device
        self.members = members
        self.index = {id(m.owner()): i for i, m in enumerate(members)}
        self.sizes = [m.d_out for m in members]
        total = sum(self.sizes)
        self.norm = torch.empty(total, dtype=torch.float32, device=device)
        self.scales = torch.empty((3, total), dtype=torch.float32, device=device)
        self.graph = None
        self.runs = 0

    @classmethod
    def build(cls, device, members: list[_Member]) -> _Group | None:
        members = [m for m in members if m.trains()]
        if len(members) < 2:
            return None
        group = cls(device, members)
        inputs = group._inputs()
        if inputs is None:
            return None
        if device.type == "cuda":
            try:
                group._capture(inputs)
            except Exception as e:  # noqa: BLE001 - costs speed, never correctness
                backend.warn_once("norm_group", f"flashdora: norm group capture failed, layers recompute alone ({e})")
                return None
        return group

    def _inputs(self) -> list | None:
        """Each member's ``(cache, keys, tensors, w_sq)`` now, or ``None`` when one no longer fits the group."""
        from flashdora.ops.norm import NormCache, _storage, _tensor_keys

        out = []
        for m in self.members:
            if not m.trains():
                return None
            tensors = w, a, b, mag = tuple(ref() for ref in m.tensors)
            cache = m.owner().__dict__.get("_flashdora_cache")
            if cache is None:
                return None
            keys = _tensor_keys(w, a, b, mag)
            w_sq = NormCache._weight_sq(cache, keys[0], w, True)  # ||W||^2 of W as it is now, in its buffer
            if _storage(keys, m.scaling, w_sq) != m.storage:
                return None
            out.append((cache, keys, tensors, w_sq))
        return out

    def _compute(self, inputs) -> None:
        from flashdora.kernels.norm import norm_and_scales

        off = 0
        for m, (_, _, (w, a, b, mag), w_sq) in zip(self.members, inputs):
            end = off + m.d_out
            norm_and_scales(w, a, b, m.scaling, mag, out=(self.norm[off:end], self.scales[:, off:end]), w_sq=w_sq)
            off = end

    def _capture(self, inputs) -> None:
        from flashdora.kernels.norm import _graph_pool

        pool, stream = _graph_pool(self.device)
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._compute(inputs)  # uncaptured first: autotuning and cuBLAS workspaces outside the graph
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self._compute(inputs)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = graph

    def run(self) -> bool:
        """Recompute every member and file its result in its cache; ``False`` (nothing filed) when the group no
        longer fits its members."""
        from flashdora.ops.norm import _optimizer_steps_now

        inputs = self._inputs()
        if inputs is None:
            return False
        with torch.no_grad():
            if self.graph is not None:
                self.graph.replay()
            else:
                self._compute(inputs)
            norms = self.norm.clone().split(self.sizes)  # fresh copies: earlier results may still be in use
            scales = self.scales.clone().split(self.sizes, dim=1)
        steps = _optimizer_steps_now()
        for m, (cache, keys, _, _), norm, sc in zip(self.members, inputs, norms, scales):
            key = (keys[0], keys[1], keys[2], m.scaling, steps)
            cache["norm"], cache["scales"], cache["norm_key"], cache["scales_key"] = norm, sc, key, (key, keys[3])
        backend.count("norm:triton", len(self.members))
        self.runs += 1
        return True
