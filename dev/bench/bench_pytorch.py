#!/usr/bin/env python3
"""Side-by-side reference for dev/bench/bench_attention.sh: one GPT-2 training step in PyTorch
(fp32, eager, llm.c's train_gpt2.py model: causal attention written out as q@k^T, mask,
softmax, @v; AdamW), the median of several steps after a warm-up, on the same machine and
threads as train_gpt2. Not part of make test: the project has no Python dependency; this is
only the comparison (Debian: apt-get install python3-torch, torch 1.13 + OpenBLAS).

usage: bench_pytorch.py L C NH V B T steps threads   -> prints "pytorch T=<T> ms=<median>"
"""
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH, T):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.NH = NH
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.NH, C // self.NH).transpose(1, 2)
        k = k.view(B, T, self.NH, C // self.NH).transpose(1, 2)
        v = v.view(B, T, self.NH, C // self.NH).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, NH, V, T):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList([Block(C, NH, T) for _ in range(L)])
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()   # tied LM head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    L, C, NH, V, B, T, steps, threads = (int(a) for a in sys.argv[1:9])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT(L, C, NH, V, T)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    idx = torch.randint(0, V, (B, T))
    tgt = torch.randint(0, V, (B, T))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    print("pytorch T=%d ms=%.1f" % (T, times[len(times) // 2] * 1e3))


if __name__ == "__main__":
    main()
