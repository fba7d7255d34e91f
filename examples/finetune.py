"""Fine-tune a Llama-family model with YaRN or Resonance-YaRN patched in by ropescale.

One command on the CPU (a tiny Llama built from a config, synthetic data, a few steps):

    python examples/finetune.py --method resonance_yarn --factor 4 --steps 20

The same script on GPUs with torch.distributed, unchanged (DDP by default, FSDP with --fsdp):

    torchrun --nproc_per_node 8 examples/finetune.py --model /path/to/llama --method yarn --factor 16 \
        --seq-len 65536 --steps 400 --lr 2e-5 --fsdp

The data is synthetic (no downloads): each sequence counts from a random start with its own stride
(x[t+1] = x[t] + stride mod vocab), so the loss falls within a few dozen steps once the model reads
the previous tokens at every position of the extended context. Point --data at a token file (a 1-D
int64 torch tensor saved with torch.save) for real text.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ropescale import hf, scaling


def build_model(args) -> torch.nn.Module:
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16 if args.bf16 else None)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.original_length)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def method_for(args) -> scaling.RopeScaling:
    resonance = args.method.startswith("resonance_")
    return scaling.YaRN(factor=args.factor, original_max_position=args.original_length, resonance=resonance)


def batches(args, vocab, rank, world):
    gen = torch.Generator().manual_seed(args.seed + rank)
    data = torch.load(args.data) if args.data else None
    while True:
        if data is not None:
            starts = torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=gen)
            yield torch.stack([data[s:s + args.seq_len] for s in starts.tolist()])
        else:
            start = torch.randint(0, vocab, (args.batch, 1), generator=gen)
            stride = torch.randint(1, 5, (args.batch, 1), generator=gen)
            yield (start + stride * torch.arange(args.seq_len)) % vocab


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local transformers checkpoint (default: a tiny Llama from a config)")
    parser.add_argument("--method", choices=("yarn", "resonance_yarn"), default="yarn")
    parser.add_argument("--factor", type=float, default=4.0, help="scale factor s")
    parser.add_argument("--original-length", type=int, default=64, help="pre-training context L (tiny model)")
    parser.add_argument("--seq-len", type=int, default=256, help="training length (s * L by default usage)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per process per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--data", help="token file: a 1-D int64 tensor saved with torch.save")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    model = build_model(args)
    if args.model:
        args.original_length = model.config.max_position_embeddings
    hf.patch(model, method_for(args))
    model.to(device).train()
    if world > 1:
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    vocab = (model.module if hasattr(model, "module") else model).config.vocab_size
    data = batches(args, vocab, rank, world)
    start = time.perf_counter()
    for step in range(args.steps):
        x = next(data).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:.1f}s", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
