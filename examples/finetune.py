"""Fine-tune a Llama-family model with YaRN or Resonance-YaRN patched in by ropescale.

One command on the CPU (a tiny Llama built from a config, synthetic data, a few steps):

    python examples/finetune.py --method resonance_yarn --factor 4 --steps 20

The same script on GPUs with torch.distributed, unchanged (DDP by default, FSDP with --fsdp):

    torchrun --nproc_per_node 8 examples/finetune.py --model /path/to/llama --method yarn --factor 16 \
        --seq-len 65536 --steps 400 --lr 2e-5 --fsdp --output-dir out-fsdp

(with --fsdp every rank gathers the full state dict at the end and rank 0 writes OUTPUT_DIR/final)

With transformers' Trainer (checkpoints every --save-steps, resumable) and/or PEFT LoRA on q/k/v/o:

    python examples/finetune.py --trainer --output-dir out --save-steps 10 --steps 20
    python examples/finetune.py --trainer --output-dir out2 --steps 20 --resume out/checkpoint-10
    python examples/finetune.py --lora --output-dir out-lora --steps 20

With --output-dir the trained model (LoRA merged into it) is saved to OUTPUT_DIR/final: the patch is
recorded in its config, so `AutoModelForCausalLM.from_pretrained(OUTPUT_DIR/final)` gives the trained
model back (after `import ropescale.hf` for ropescale's own rope types such as resonance_yarn), and so
does every Trainer checkpoint. OUTPUT_DIR/probe.pt holds a fixed batch and the trained model's logits
on it, to check a reload against. `--model OUTPUT_DIR/final --method saved` fine-tunes it further.

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
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.bf16 else None)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.original_length)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def patch(model, args) -> None:
    if args.method == "saved":  # what the checkpoint's config records (a model this script saved)
        hf.patch(model)
        return
    if args.model:  # the pre-training length: a checkpoint's own original length, else its context
        params = model.config.rope_parameters
        args.original_length = params.get("original_max_position_embeddings") or model.config.max_position_embeddings
    resonance = args.method.startswith("resonance_")
    hf.patch(model, scaling.YaRN(factor=args.factor, original_max_position=args.original_length, resonance=resonance))


def add_lora(model, args):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, config)


def batches(args, vocab, rank, world, seed_offset=0):
    gen = torch.Generator().manual_seed(args.seed + rank + seed_offset)
    data = torch.load(args.data) if args.data else None
    while True:
        if data is not None:
            starts = torch.randint(0, data.numel() - args.seq_len, (args.batch,), generator=gen)
            yield torch.stack([data[s:s + args.seq_len] for s in starts.tolist()])
        else:
            start = torch.randint(0, vocab, (args.batch, 1), generator=gen)
            stride = torch.randint(1, 5, (args.batch, 1), generator=gen)
            yield (start + stride * torch.arange(args.seq_len)) % vocab


def log_step(step: int, loss: float, start: float) -> None:
    print(f"step {step:4d}  loss {loss:.6f}  {time.perf_counter() - start:.1f}s", flush=True)


def train_loop(model, args, device, rank, world) -> torch.nn.Module:
    """The plain loop: DDP by default under torchrun, FSDP2 with --fsdp. Returns the unwrapped model."""
    trained = model
    if world > 1:
        if args.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    data = batches(args, trained.config.vocab_size, rank, world)
    start = time.perf_counter()
    for step in range(args.steps):
        x = next(data).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            log_step(step + 1, loss.item(), start)
    return trained


class SyntheticDataset(torch.utils.data.Dataset):
    """``steps * batch`` sequences from the same generator as the plain loop, for the Trainer."""

    def __init__(self, args, vocab):
        data = batches(args, vocab, rank=0, world=1)
        self.rows = torch.cat([next(data) for _ in range(args.steps)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def train_trainer(model, args) -> torch.nn.Module:
    """transformers' Trainer: checkpoints every --save-steps (each one a loadable patched model, or the
    LoRA adapter), --resume from one. Under torchrun/accelerate the Trainer does the distribution."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    start = time.perf_counter()

    class PrintLoss(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                log_step(state.global_step, logs["loss"], start)

    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup, bf16=args.bf16,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to="none", disable_tqdm=True, seed=args.seed, dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=targs, train_dataset=SyntheticDataset(args, model.config.vocab_size),
                      callbacks=[PrintLoss()])
    resume = True if args.resume == "last" else args.resume
    trainer.train(resume_from_checkpoint=resume)
    return trainer.model


def probe(args, vocab) -> torch.Tensor:
    """A fixed batch (not a training one) to compare the trained model with a reload."""
    return next(batches(args, vocab, rank=0, world=1, seed_offset=1000))


def save(model, args, device, rank: int = 0, sharded: bool = False) -> None:
    """OUTPUT_DIR/final (LoRA merged in) and OUTPUT_DIR/probe.pt: the trained model's logits on a fixed batch.
    FSDP (sharded): every rank runs the probe forward and gathers the full state dict (collectives),
    rank 0 writes them."""
    x = probe(args, model.config.vocab_size).to(device)
    model.eval()
    with torch.no_grad():
        logits = model(x).logits.float().cpu()
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            final = os.path.join(args.output_dir, "final")
            model.save_pretrained(final, state_dict=state)
            torch.save({"input_ids": x.cpu(), "logits": logits}, os.path.join(args.output_dir, "probe.pt"))
            print(f"saved {final} (rope_type {model.config.rope_parameters['rope_type']}, gathered from FSDP)",
                  flush=True)
        return
    if args.lora:
        model = model.merge_and_unload()  # the same module tree with plain Linear layers: still patched
        print(f"LoRA merged: ropescale patch kept: {hf.is_patched(model)}", flush=True)
    final = os.path.join(args.output_dir, "final")
    model.save_pretrained(final)
    torch.save({"input_ids": x.cpu(), "logits": logits}, os.path.join(args.output_dir, "probe.pt"))
    print(f"saved {final} (rope_type {model.config.rope_parameters['rope_type']})", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local transformers checkpoint (default: a tiny Llama from a config)")
    parser.add_argument("--method", choices=("yarn", "resonance_yarn", "saved"), default="yarn",
                        help="saved: what --model's config records (a checkpoint this script wrote)")
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
    parser.add_argument("--output-dir", help="save the trained model to OUTPUT_DIR/final (Trainer checkpoints here too)")
    parser.add_argument("--trainer", action="store_true", help="train with transformers' Trainer")
    parser.add_argument("--save-steps", type=int, default=0, help="Trainer: a checkpoint every N steps")
    parser.add_argument("--resume", metavar="CHECKPOINT", help="Trainer: resume from a checkpoint dir ('last': the latest)")
    parser.add_argument("--lora", action="store_true", help="PEFT LoRA on q/k/v/o (merged into the saved model)")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args(argv)
    if args.trainer and not args.output_dir:
        parser.error("--trainer needs --output-dir (its checkpoints go there)")
    if (args.save_steps or args.resume) and not args.trainer:
        parser.error("--save-steps and --resume are Trainer options: add --trainer")
    if args.trainer and args.fsdp:
        parser.error("--fsdp shards the plain loop; with --trainer, launch with `accelerate launch` and an FSDP config")
    if args.fsdp and args.lora:
        parser.error("--lora with --fsdp is not supported by this example (merge needs the full weights)")
    if args.method == "saved" and not args.model:
        parser.error("--method saved needs --model (a checkpoint whose config records a method)")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    model = build_model(args)
    patch(model, args)  # before LoRA: PEFT wraps the projections inside the patched attention
    if args.lora:
        model = add_lora(model, args)
    if args.trainer:
        model = train_trainer(model, args)  # the Trainer moves the model and sets up distribution itself
    else:
        if world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model = train_loop(model.to(device).train(), args, device, rank, world)
    sharded = args.fsdp and world > 1 and not args.trainer
    if args.output_dir and (rank == 0 or sharded):
        save(model, args, device, rank, sharded)
    if world > 1 and dist.is_initialized():
        # every rank waits for rank 0's save before the group goes: a rank tearing gloo down while another still
        # works aborted at exit under load ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
