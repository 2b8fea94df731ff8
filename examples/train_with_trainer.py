"""Fine-tune a PEFT DoRA model with Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``): one added line for flashdora.

    python examples/train_with_trainer.py                  # tiny random Llama; CPU (fp32) or GPU (bf16)
    python examples/train_with_trainer.py --no-flashdora   # the same run on PEFT's own DoRA, to compare losses
    python examples/train_with_trainer.py --size small --max-steps 200
    torchrun --nproc_per_node 2 examples/train_with_trainer.py --skip-trl   # the Trainer's DDP over two processes
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/train_with_trainer.py --skip-trl  # FSDP2

Everything is offline: the model is a random Llama and the text is the standard library's Python source as
byte-level tokens (ids 0..255), so no hub model, tokenizer or dataset is needed. With your own model, build it with
``from_pretrained`` and tokenize your text as usual; the flashdora line stays the same.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import flashdora
from flashdora.tools.parity import sample_batches, stdlib_corpus

# name -> (hidden, layers, intermediate, heads, kv heads); the vocabulary is the 256 byte values
SIZES = {"tiny": (64, 2, 128, 4, 2), "small": (256, 4, 688, 8, 4)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--no-flashdora", action="store_true", help="run PEFT's own DoRA (the baseline)")
    parser.add_argument("--skip-trl", action="store_true", help="only the plain Trainer part")
    return parser.parse_args(argv)


def random_llama(size: str) -> LlamaForCausalLM:
    """A randomly initialised Llama with a 256-entry (byte) vocabulary; stands in for ``from_pretrained``."""
    hidden, layers, inter, heads, kv = SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=256,
        pad_token_id=0,  # NUL: never in the text
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def dora_config(rank: int) -> LoraConfig:
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05, use_dora=True, target_modules=TARGETS)


def byte_examples(count: int, seq: int) -> list[dict[str, list[int]]]:
    """``count`` windows of ``seq`` byte tokens from the standard library's sources, as tokenized examples."""
    return [{"input_ids": ids.tolist()} for ids in sample_batches(stdlib_corpus(), 1, count, seq, seed=0)[0]]


class CausalLMDataset(torch.utils.data.Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ids = torch.tensor(self.examples[i]["input_ids"])
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels


def training_args(args, output_dir: str, cls=TrainingArguments, **extra):
    return cls(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        logging_steps=max(1, args.max_steps // 10),
        bf16=torch.cuda.is_available(),  # bf16 autocast over fp32 adapters on GPU; fp32 on CPU
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        report_to="none",
        seed=0,
        **extra,
    )


def train_with_trainer(args, output_dir: str) -> float:
    model = get_peft_model(random_llama(args.size), dora_config(args.rank))
    if not args.no_flashdora:
        flashdora.enable(model)  # <- the one added line
    dataset = CausalLMDataset(byte_examples(args.max_steps * args.batch, args.seq))
    trainer = Trainer(model=model, args=training_args(args, output_dir, label_names=["labels"]), train_dataset=dataset)
    loss = trainer.train().training_loss
    report(f"Trainer: {_wrapping(trainer.model_wrapped)}")
    return loss


def _wrapping(model) -> str:
    """How the Trainer (accelerate) ran the model: FSDP2, DDP or one process."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2's public name
        FSDPModule = ()
    sharded = sum(isinstance(m, FSDPModule) for m in model.modules())  # (isinstance(m, ()) is False)
    if sharded:
        return f"FSDP2, {sharded} modules sharded"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "DDP"
    return "one process"


def byte_tokenizer():
    """A byte-level fast tokenizer (token id = byte value, GPT-2's byte-to-character map); TRL needs one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    extra = iter(range(256, 512))
    chars = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=chars[0], eos_token=chars[0])


def train_with_sft_trainer(args, output_dir: str) -> float:
    """TRL builds the PEFT model itself from ``peft_config``, so flashdora hooks in process-wide."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if not args.no_flashdora:
        flashdora.patch_peft()  # <- the one added line (every PEFT DoRA layer made from now on runs flashdora)
    dataset = Dataset.from_list(byte_examples(args.max_steps * args.batch, args.seq))
    config = training_args(args, output_dir, cls=SFTConfig, max_length=args.seq, packing=False)
    trainer = SFTTrainer(
        model=random_llama(args.size),
        args=config,
        train_dataset=dataset,
        processing_class=byte_tokenizer(),
        peft_config=dora_config(args.rank),
    )
    try:
        return trainer.train().training_loss
    finally:
        flashdora.unpatch_peft()


def report(line: str) -> None:
    """Print ``line`` in one write: under torchrun or accelerate every process runs this script on one terminal or
    pipe, and a ``print`` split into several writes can interleave with another process's line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _flashdora_calls() -> int:
    counts = flashdora.stats()
    return counts.get("eager", 0) + counts.get("triton", 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = "PEFT's own DoRA" if args.no_flashdora else "flashdora"
    report(f"Trainer: '{args.size}' random Llama, DoRA r={args.rank}, {args.max_steps} steps, {mode}")
    flashdora.reset_stats()
    with tempfile.TemporaryDirectory() as tmp:
        report(f"Trainer: mean training loss {train_with_trainer(args, tmp):.4f}")
    calls = [_flashdora_calls()]
    try:
        import trl  # noqa: F401
    except ImportError:
        trl = None
    if args.skip_trl or trl is None:
        report("SFTTrainer: skipped (" + ("--skip-trl" if args.skip_trl else "trl is not installed") + ")")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report(f"SFTTrainer: mean training loss {train_with_sft_trainer(args, tmp):.4f}")
        calls.append(_flashdora_calls() - calls[0])
    report(f"flashdora path counters: {dict(sorted(flashdora.stats().items()))}")
    if not args.no_flashdora and min(calls) == 0:
        print("error: flashdora did not run in every trainer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # (under torchrun: the Trainer's process group, closed before exit)
    sys.exit(code)
