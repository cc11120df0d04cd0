"""A small Accelerate training loop that checkpoints asynchronously with aiopersist.

    accelerate launch --config_file integrations/accelerate/cpu_2proc.yaml \\
        integrations/accelerate/train.py --out /tmp/aiopersist-accelerate --steps 20

It saves `accelerator.save_state`'s layout every `--every` steps without stopping for
the write: the save runs while the next forward and backward do, and only the next
optimizer step waits for it (`wait_staged`). On a rerun it resumes from the newest
checkpoint with Accelerate's own `load_state`.
"""

from __future__ import annotations

import argparse
import os
import re

import torch
from accelerate import Accelerator

import aiopersist
from aiopersist.integrations.accelerate import save_state_blocking


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="accelerate-run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)

    done = sorted(
        int(m.group(1))
        for n in (os.listdir(args.out) if os.path.isdir(args.out) else [])
        if (m := re.match(r"step-(\d+)$", n))
    )
    start = 0
    if done:
        start = done[-1]
        accelerator.load_state(os.path.join(args.out, f"step-{start}"))
        accelerator.print(f"resumed from step {start}")

    handle = None
    with aiopersist.BlockingCheckpointer() as ckpt:
        for step in range(start + 1, args.steps + 1):
            x = torch.randn(32, 256, device=accelerator.device)
            loss = (model(x) - x).pow(2).mean()
            accelerator.backward(loss)
            if handle is not None:
                handle.wait_staged()  # the fence: the save has left the tensors
            opt.step()
            opt.zero_grad()
            if step % args.every == 0:
                handle = save_state_blocking(
                    accelerator, os.path.join(args.out, f"step-{step}"), checkpointer=ckpt
                )
                accelerator.print(f"step {step}: loss {loss.item():.4f}, checkpoint started")
        if handle is not None:
            handle.wait()
    accelerator.wait_for_everyone()
    accelerator.print("done")


if __name__ == "__main__":
    main()
