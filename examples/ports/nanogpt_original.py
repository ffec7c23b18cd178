"""A plain PyTorch GPT trainer in the shape of nanoGPT's train.py, on synthetic tokens made here.

A tiny GPT (causal self-attention, GELU MLP, tied embeddings) learns a noisy modular sequence. The loop
is nanoGPT's: gradient accumulation over micro-batches, a GradScaler (enabled only for float16 on a GPU),
a warm-up and cosine learning-rate schedule written into the optimizer's param_groups, clipping after
`unscale_`, periodic evaluation, a checkpoint of the best model and resuming from it, and a float64
switch. nanogpt_port.py is this script ported to stratagem; `diff -u nanogpt_original.py nanogpt_port.py`.

    python examples/ports/nanogpt_original.py --max-iters 20 --dtype float64
"""
import argparse
import math
import os
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd)))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(F.gelu(m.c_fc(x)))  # minGPT's way of writing the MLP

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def synthetic_tokens(n, vocab_size, seed):
    """A token stream with structure to learn: each token is 3 more than the one before, modulo the vocabulary,
    with one token in ten replaced at random."""
    g = torch.Generator().manual_seed(seed)
    tokens = (torch.arange(n) * 3 + torch.randint(0, vocab_size, (1,), generator=g)) % vocab_size
    noisy = torch.rand(n, generator=g) < 0.1
    return torch.where(noisy, torch.randint(0, vocab_size, (n,), generator=g), tokens)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", default="out-nanogpt")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--max-iters", type=int, default=40)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--eval-iters", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--warmup-iters", type=int, default=5)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    if args.dtype == "float64":
        torch.set_default_dtype(torch.float64)
    ctx = nullcontext() if args.dtype != "float16" else torch.autocast(device, dtype=torch.float16)
    vocab_size, block_size = 32, args.block_size
    data = {"train": synthetic_tokens(20000, vocab_size, 0), "val": synthetic_tokens(2000, vocab_size, 1)}
    batch_generator = torch.Generator().manual_seed(args.seed)

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - block_size, (args.batch_size,), generator=batch_generator)
        x = torch.stack([d[i : i + block_size] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + block_size] for i in ix])
        return x.to(device), y.to(device)

    iter_num, best_val_loss = 0, 1e9
    model = GPT(vocab_size, block_size, n_layer=2, n_head=2, n_embd=32, dropout=args.dropout)
    checkpoint = None
    if args.resume:
        checkpoint = torch.load(os.path.join(args.out_dir, "ckpt.pt"), map_location=device)
        model.load_state_dict(checkpoint["model"])
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        batch_generator.set_state(checkpoint["batch_generator"])
    model.to(device)
    scaler = torch.amp.GradScaler(device, enabled=(args.dtype == "float16" and device == "cuda"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])

    def get_lr(it):
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        decay_ratio = (it - args.warmup_iters) / max(1, args.max_iters - args.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * min(decay_ratio, 1.0)))
        return args.min_lr + coeff * (args.learning_rate - args.min_lr)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    X, Y = get_batch("train") if checkpoint is None else checkpoint["batch"]
    while iter_num < args.max_iters:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            batch_state = batch_generator.get_state()  # a resumed run evaluates again, drawing the same batches
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.12f}, val loss {losses['val']:.12f}")
            if losses["val"] < best_val_loss and iter_num > 0:
                best_val_loss = losses["val"]
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "iter_num": iter_num,
                    "best_val_loss": best_val_loss,
                    "batch_generator": batch_state,
                    "batch": (X, Y),
                }
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
        for micro_step in range(args.gradient_accumulation_steps):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / args.gradient_accumulation_steps
            scaler.scale(loss).backward()
            if micro_step == args.gradient_accumulation_steps - 1:  # the last micro-batch: update
                if args.grad_clip != 0.0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            X, Y = get_batch("train")
        print(f"iter {iter_num}: loss {loss.item() * args.gradient_accumulation_steps:.12f}, lr {lr:.6e}")
        iter_num += 1
    print(f"final: {sum(p.double().sum().item() for p in model.parameters()):.12f}")


if __name__ == "__main__":
    main()
