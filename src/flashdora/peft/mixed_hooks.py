"""PEFT's model-level ``adapter_names`` plumbing on enabled models, without its per-call module walks.

PEFT's ``LoraModel._enable_peft_forward_hooks`` runs around every forward that gets ``adapter_names``: it walks every
module of the model twice (to check the names exist, then to register a pre-forward hook on each LoRA layer that
injects the names into its call) and removes the hooks after. Each adapter adds modules, so on an 8B model with a
few adapters the walks cost more host time than the layers' own work in a decoding step, and a step is host time.

On a model ``enable`` switched, ``install`` puts ``fast_hooks`` in its place on the ``LoraModel`` instance: PEFT's
checks with PEFT's messages, over the model's LoRA layers listed once and listed again only after a submodule is
registered into one of the model's modules, or a LoRA layer or ``modules_to_save`` wrapper anywhere (a module
registration hook; a model that slices its layer list in every forward registers into new containers, which do not
count). flashdora's layers get the names as an attribute for the forward's duration (``NAMES``; an attribute, not
a context variable, which ``torch.compile`` cannot trace); PEFT's hook goes on any other LoRA layer and wrapper, as
PEFT does. Beam search, aLoRA offsets and encoder-decoder models run PEFT's own method. ``disable`` uninstalls it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from peft.tuners.lora import model as lora_model
from peft.tuners.lora.layer import LoraLayer
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from flashdora import config

_PEFT_HOOKS = lora_model.LoraModel._enable_peft_forward_hooks
_KINDS = (LoraLayer, AuxiliaryTrainingWrapper)
NAMES = "_flashdora_adapter_names"  # a flashdora layer's attribute while a forward with adapter_names runs
_structure = 0  # registrations that may change a listed model's LoRA layers (the lists' validity)
_members: weakref.WeakSet = weakref.WeakSet()  # every module of the models listed so far
_handle = None


def _registered(module, name, submodule):
    global _structure
    if torch.compiler.is_compiling():  # (a ModuleList sliced in a compiled forward: a guard on _members, which the
        return  # garbage collector shrinks, failed its own compile with InternalTorchDynamoError on an H200)
    if module in _members or isinstance(submodule, _KINDS):
        _structure += 1


def install(model: nn.Module) -> None:
    """``fast_hooks`` on every ``LoraModel`` in ``model`` (PEFT's private surface: tested versions only)."""
    global _handle
    if not config.peft_tested():
        return
    if _handle is None:
        _handle = nn.modules.module.register_module_module_registration_hook(_registered)
    for module in model.modules():
        if isinstance(module, lora_model.LoraModel):
            module.__dict__["_flashdora_layers"] = _Layers()
            module._enable_peft_forward_hooks = functools.partial(fast_hooks, module)  # (pickles by name)


def uninstall(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, lora_model.LoraModel):
            module.__dict__.pop("_enable_peft_forward_hooks", None)
            module.__dict__.pop("_flashdora_layers", None)


class _Layers(list):
    """A model's layer lists and the structure count they were made at; copies and pickles start empty."""

    def __deepcopy__(self, memo):
        return _Layers()

    def __reduce__(self):
        return _Layers, ()


def _layers(self) -> tuple:
    """``(the model's LoRA layers and wrappers, whether the model has an encoder)``. Which of them read the names
    from ``NAMES`` is asked at each call, from their class: ``enable`` and ``disable`` of one layer re-class it."""
    kept = self.__dict__.get("_flashdora_layers")
    if kept and kept[0] == _structure:
        return kept[1]
    layers = []
    for module in self.modules():
        _members.add(module)
        if isinstance(module, _KINDS):
            layers.append(module)
    encoder = lora_model._get_encoder(self.model) is not None
    lists = (tuple(layers), encoder)
    self.__dict__["_flashdora_layers"] = _Layers([_structure, lists])
    return lists


@contextlib.contextmanager
def fast_hooks(self, *args, **kwargs):
    """``LoraModel._enable_peft_forward_hooks`` for an enabled model (module docstring)."""
    names = kwargs.get("adapter_names")
    num_beams = kwargs.get("num_beams")
    beams = isinstance(num_beams, int) and num_beams > 1
    layers, encoder = _layers(self) if names is not None else ((), False)
    if names is None or kwargs.get("alora_offsets") is not None or beams or encoder:
        with _PEFT_HOOKS(self, *args, **kwargs):
            yield
        return
    if self.training:
        raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
    expected, ours, others = set(), [], []
    for layer in layers:
        if isinstance(layer, LoraLayer):
            expected |= layer.lora_A.keys()
            expected |= layer.lora_embedding_A.keys()
        (ours if getattr(type(layer), "_flashdora_reads_names", False) else others).append(layer)
    unexpected = {name for name in names if name != "__base__"} - expected
    if unexpected:
        raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unexpected))}")
    hook = functools.partial(lora_model._adapter_names_pre_forward_hook, adapter_names=names)
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True) for module in others]
    for layer in ours:
        layer.__dict__[NAMES] = names
    try:
        yield
    finally:
        for layer in ours:
            layer.__dict__.pop(NAMES, None)
        for handle in handles:
            handle.remove()
