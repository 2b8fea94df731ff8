"""The README and docs/*.md: every relative link resolves, every linked number is in the file it links, every cited
result file is listed in benchmarks/results/README.md and shipped in the sdist (MANIFEST.in), and every README Python
block runs clean."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
INLINE = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")  # [text](target)
REF_USE = re.compile(r"\[([^\]]*)\]\[([^\]]+)\]")  # [text][name]
REF_DEF = re.compile(r"^\[([^\]]+)\]:\s*(\S+)", re.M)  # [name]: target
NUMBER = re.compile(r"^\**(-?\d[\d.,]*)\s*(ms|s|GiB|x)?\**$")  # a linked cell such as "98.70 ms"


def links(doc: Path) -> list[tuple[str, str]]:
    """(link text, target) of every inline and reference-style link of ``doc``, targets without their #fragment."""
    text = doc.read_text()
    refs = dict(REF_DEF.findall(text))
    found = INLINE.findall(text) + [(t, refs[name]) for t, name in REF_USE.findall(text) if name in refs]
    return [(t, target.split("#")[0]) for t, target in found if target.split("#")[0]]


def local(target: str) -> bool:
    return not re.match(r"[a-z]+:", target)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc):
    broken = [target for _, target in links(doc) if local(target) and not (doc.parent / target).exists()]
    assert not broken, f"{doc.name} links files that are not there: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_a_linked_number_is_in_the_file_it_links(doc):
    wrong = []
    for text, target in links(doc):
        number = NUMBER.match(text.strip())
        if number and local(target) and RESULTS in (doc.parent / target).resolve().parents:
            exact = rf"(?<![\d.]){re.escape(number.group(1))}(?![\d])"  # 98.7 is not 98.70's start
            if not re.search(exact, (doc.parent / target).read_text()):
                wrong.append((text, target))
    assert not wrong, f"{doc.name}: these numbers are not in the files their links name: {wrong}"


def cited_results() -> set[str]:
    return {
        (doc.parent / target).resolve().name
        for doc in DOCS
        for _, target in links(doc)
        if local(target) and RESULTS in (doc.parent / target).resolve().parents
    }


def test_the_readme_table_links_its_result_file():
    assert "2026-11-26_nvidia-h100-80gb-hbm3_model-8b-after-dcd3d24.md" in cited_results()


def test_the_results_index_lists_every_cited_file():
    index = (RESULTS / "README.md").read_text()
    missing = sorted(name for name in cited_results() if f"]({name})" not in index)
    assert not missing, f"benchmarks/results/README.md does not list {missing}"


def test_the_sdist_ships_every_cited_result_file():
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include benchmarks/results *.md *.txt" in manifest
    missing = sorted(
        name
        for name in cited_results()
        if Path(name).suffix not in (".md", ".txt") and f"include benchmarks/results/{name}" not in manifest
    )
    assert not missing, f"MANIFEST.in leaves out cited result files {missing}"


# The README's Python blocks run as a user would paste them: a whole script each, in a fresh interpreter with Python's
# default warning filters. A fragment (it uses names an earlier block or the text defines) runs between its prelude
# and postlude below; a block that cannot run here says why. Keyed by a line of the block.
QUICK_START_MODEL = """import torch
import flashdora
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_dropout=0.1, use_dora=True,
                                                            target_modules="all-linear"))
"""
TRAINER = """import tempfile
from transformers import Trainer, TrainingArguments
ids = torch.randint(0, 256, (4, 16))
dataset = [{"input_ids": row, "labels": row} for row in ids]
training_args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2,
                                  use_cpu=True, save_strategy="no", report_to="none", disable_tqdm=True)
"""
FORWARD = "\nmodel.train()\nmodel(input_ids=torch.randint(0, 256, (2, 8)), labels=torch.randint(0, 256, (2, 8)))\n"
FRAGMENTS = {  # key: (prelude, postlude)
    "trainer.train()": (QUICK_START_MODEL + TRAINER, ""),
    'flashdora.enable(model, dropout="adapter")': (QUICK_START_MODEL, FORWARD),
}
NOT_RUN = {"meta-llama/Llama-3.1-8B": "downloads an 8B model from the Hugging Face Hub"}
# After each block: flashdora ran (a fused path), so a snippet that silently ran PEFT's code fails.
RAN = "\nassert sum(v for k, v in flashdora.stats().items() if not k.startswith(('norm', 'peft'))) > 0\n"


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _key(block: str, table: dict) -> str | None:
    return next((k for k in table if k in block), None)


def _block_id(block: str) -> str:
    return re.sub(r"[^\w.=(),\"-]+", "-", block.strip().splitlines()[-1])[:40]


_BNB_CPU_LINE = "Failed to load CPU gemm_4bit_forward from kernels-community"  # (bitsandbytes 0.50 on some hosts)


@pytest.mark.parametrize("block", readme_blocks(), ids=_block_id)
def test_every_readme_snippet_runs_clean(block, tmp_path):
    """Each block runs to the end, reaches flashdora, and prints no warning a user would see (flashdora's own, or one
    that PEFT or transformers raise about the snippet's arguments: an adapter name, a missing attention mask). The
    serving block prints each request's tokens and their check against PEFT's own DoRA."""
    if _key(block, NOT_RUN):
        ast.parse(block)  # still valid Python
        pytest.skip(f"not runnable here: {NOT_RUN[_key(block, NOT_RUN)]}")
    fragment = _key(block, FRAGMENTS)
    assert fragment or block.lstrip().startswith("import "), f"a README block that is neither whole nor known: {block}"
    prelude, postlude = FRAGMENTS[fragment] if fragment else ("", "")
    script = tmp_path / "snippet.py"
    script.write_text(prelude + block + postlude + RAN)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Python's warnings, PEFT's and transformers' log lines: all on stderr, which a clean snippet leaves empty (but
    # for bitsandbytes' own line at its import on some CPUs, which any user of it there sees, flashdora or not)
    stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith(_BNB_CPU_LINE))
    assert not stderr.strip(), f"the snippet printed warnings: {proc.stderr[-3000:]}"
    if "adapter_names=" in block:
        assert "attention_mask=" in block
        rows = proc.stdout.strip().splitlines()
        assert [r.split(":")[0].strip() for r in rows] == ["chat", "code", "__base__"], proc.stdout
        assert all(r.endswith("same as PEFT: True") for r in rows), proc.stdout


def test_fragment_and_not_run_keys_still_name_readme_blocks():
    """An entry of NOT_RUN or FRAGMENTS whose block is gone is stale: every key still names a README block."""
    blocks = readme_blocks()
    stale = [k for k in (*NOT_RUN, *FRAGMENTS) if not any(k in b for b in blocks)]
    assert not stale, f"tests/test_docs.py names README blocks that are gone: {stale}"
