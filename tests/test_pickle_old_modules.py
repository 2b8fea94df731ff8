"""Models pickled before the PEFT seam moved to ``flashdora.peft`` name its classes in ``flashdora.peft_integration``
and ``flashdora.peft_layers`` (or, for a while, ``flashdora.variant``), and an enabled model's ``load_state_dict``
post-hook as ``flashdora.watch._loaded``: those modules stay as re-exports, so such pickles still load (to the same
objects); pickles made now name the new modules."""

import io
import pickle

import pytest
import torch

import flashdora
import flashdora.peft_integration
import flashdora.peft_layers
from flashdora.peft import layers, switch, variant, watch
from flashdora.tools import demo

# (new module, old module) for the classes and functions a saved model can hold; a plain pickle (protocol 2) names
# each as a text line ``c<module>\n<name>\n``, so an old pickle is a new one with these lines renamed.
OLD = {
    b"cflashdora.peft.variant\n": b"cflashdora.peft_integration\n",
    b"cflashdora.peft.switch\n": b"cflashdora.peft_integration\n",
    b"cflashdora.peft.layers\n": b"cflashdora.peft_layers\n",
    b"cflashdora.peft.watch\n": b"cflashdora.watch\n",
}


def _old(data: bytes) -> bytes:
    for new, old in OLD.items():
        data = data.replace(new, old)
    return data


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


def test_an_enabled_model_pickled_with_the_old_module_names_loads():
    model = flashdora.enable(demo.build_peft_model("tiny", 4, 0.0, "cpu"))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    data = pickle.dumps(model, protocol=2)
    assert b"cflashdora.peft.variant\nFlashDoraLinearVariant\n" in data  # new pickles name the new modules
    assert b"cflashdora.peft.layers\nFlashDoraLinear\n" in data
    assert b"cflashdora.peft.watch\n_loaded\n" in data
    old = _old(data)
    assert b"cflashdora.peft_integration\nFlashDoraLinearVariant\n" in old
    assert b"cflashdora.peft_layers\nFlashDoraLinear\n" in old and b"cflashdora.watch\n_loaded\n" in old
    assert b"flashdora.peft." not in old.replace(b"cflashdora.peft.mixed_hooks\n", b"")  # (newer than the old names)
    loaded = pickle.loads(old)
    kinds = {type(m) for m in loaded.modules()} | {type(v) for m in loaded.modules() for v in _variants(m)}
    assert layers.FlashDoraLinear in kinds and variant.FlashDoraLinearVariant in kinds
    assert torch.equal(_logits(loaded, ids), ref)
    buf = io.BytesIO()  # torch.save's own format names the new modules too, and loads
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(_logits(torch.load(buf, weights_only=False), ids), ref)


def _variants(module):
    return getattr(module, "lora_variant", {}).values()


@pytest.mark.parametrize(
    "module, name, expected",
    [
        ("flashdora.peft_integration", "FlashDoraLinearVariant", lambda: variant.FlashDoraLinearVariant),
        ("flashdora.peft_integration", "PeftDoraLinearVariant", lambda: variant.PeftDoraLinearVariant),
        ("flashdora.peft_integration", "FlashDoraLinear", lambda: layers.FlashDoraLinear),
        ("flashdora.peft_layers", "FlashDoraLinear", lambda: layers.FlashDoraLinear),
        ("flashdora.watch", "_loaded", lambda: watch._loaded),
        ("flashdora.variant", "FlashDoraLinearVariant", lambda: variant.FlashDoraLinearVariant),
        ("flashdora.variant", "PeftDoraLinearVariant", lambda: variant.PeftDoraLinearVariant),
        *[
            ("flashdora.peft_integration", cls.__name__, lambda cls=cls: cls)
            for cls in switch._counting_classes.values()
        ],
    ],
)
def test_old_class_names_resolve_to_the_new_classes(module, name, expected):
    assert pickle.loads(b"c" + f"{module}\n{name}\n".encode() + b".") is expected()


def test_counting_variants_pickled_with_the_old_module_name_load():
    held = [cls() for cls in switch._counting_classes.values()]
    data = pickle.dumps(held, protocol=2)
    assert b"cflashdora.peft.switch\nFlashDoraCountingDoraEmbeddingVariant\n" in data
    loaded = pickle.loads(_old(data))
    assert [type(v) for v in loaded] == [type(v) for v in held]
    assert flashdora.peft_integration.FlashDoraCountingDoraEmbeddingVariant is type(held[0])


def test_bitsandbytes_classes_resolve_through_the_old_module():
    pytest.importorskip("bitsandbytes")
    for kind in layers.KINDS:
        cls = pickle.loads(f"cflashdora.peft_layers\nFlashDora{kind}\n.".encode())
        assert cls is getattr(layers, f"FlashDora{kind}") and cls.__module__ == "flashdora.peft.layers"
        assert pickle.loads(pickle.dumps(cls)) is cls


def test_the_old_modules_fail_on_unknown_names():
    with pytest.raises(AttributeError, match="flashdora.peft_integration"):
        flashdora.peft_integration.Nothing  # noqa: B018
    with pytest.raises(AttributeError, match="flashdora.peft_layers"):
        flashdora.peft_layers.FlashDoraNothing  # noqa: B018
