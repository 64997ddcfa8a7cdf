"""Data-parallel training of a Hugging Face GPT-2 with AdamW and a sparsifier on its Adam path.

    torchrun --standalone --nproc_per_node=2 examples/gpt2.py --method exdyna      # the DDP hook
    horovodrun --gloo -np 2 -H localhost:2 python examples/gpt2.py --method exdyna  # Horovod
    ... examples/gpt2.py --method dense                                             # the baseline

The model is ``transformers``' ``GPT2LMHeadModel`` built from a config (2 layers, 128 wide, a
byte vocabulary: nothing is downloaded), trained on real text: the bytes of the Python standard
library's top-level modules, which every Python installation has. Each rank draws its own
windows. The changes from dense AdamW training are the optimizer's class
(``hvd_sparse.torch.optim.AdamW``, torch's arguments) and the compressor built with
``optimizer=`` (docs/methods.md#adam-and-adamw), given to Horovod's ``DistributedOptimizer`` as
``compression=`` or to DDP as its communication hook.

Prints the training loss every ``--log-every`` steps, the held-out loss at the end and the bytes a
rank put into collectives against a dense allreduce's, dense steps included; ``--out`` saves them
as JSON. Exits non-zero if the ranks' weights differ at the end.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hvd_sparse
from hvd_sparse.torch import optim

WIDTH, LAYERS, HEADS, CONTEXT = 128, 2, 4, 128
HELD_OUT = 0.05          # the text's last 5% is held out
EVAL_WINDOWS = 64


def option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--option``: VALUE as a Python literal where it reads as one."""
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def text_bytes(max_bytes: int = 4_000_000) -> np.ndarray:
    """The standard library's top-level modules, sorted by name, as one byte array."""
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        if parts and size + len(data) > max_bytes:
            break
        parts.append(data)
        size += len(data)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def batch(data: np.ndarray, rank: int, step: int, size: int, seed: int) -> torch.Tensor:
    """``size`` windows of ``CONTEXT`` bytes at offsets seeded by (seed, rank, step)."""
    starts = np.random.default_rng([seed, rank, step]).integers(0, data.size - CONTEXT, size)
    return torch.from_numpy(data[starts[:, None] + np.arange(CONTEXT)].astype(np.int64))


def gpt2(seed: int) -> GPT2LMHeadModel:
    """GPT-2 from its config at the example's size, the same initial weights on every rank."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS,
                        n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


class Horovod:
    """The Horovod face: ``compression=`` in ``hvd.DistributedOptimizer``."""

    def __init__(self) -> None:
        import horovod.torch as hvd
        hvd.init()
        self.hvd, self.rank, self.size = hvd, hvd.rank(), hvd.size()

    def wrap(self, model: torch.nn.Module, args: argparse.Namespace):
        named = list(model.named_parameters())
        optimizer = make_optimizer(model, args)
        if args.method == "dense":
            compression = None
            wrapped = self.hvd.DistributedOptimizer(optimizer, named_parameters=named)
        else:
            compression = hvd_sparse.create(args.method, framework="torch", density=args.density,
                                            named_parameters=named, **link(optimizer, args))
            wrapped = self.hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                    compression=compression)
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model, wrapped, compression

    def mean(self, value: float) -> float:
        return self.hvd.allreduce(torch.tensor(value), name="gpt2.mean").item()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.hvd.allgather(tensor[None], name="gpt2.weights")


class DDP:
    """The DDP face: the compressor as DistributedDataParallel's communication hook."""

    def __init__(self) -> None:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        self.dist, self.rank, self.size = dist, dist.get_rank(), dist.get_world_size()

    def wrap(self, model: torch.nn.Module, args: argparse.Namespace):
        from torch.nn.parallel import DistributedDataParallel

        import hvd_sparse.torch.ddp as ddp
        wrapped_model = DistributedDataParallel(model)     # broadcasts rank 0's weights
        optimizer = make_optimizer(model, args)
        if args.method == "dense":
            return wrapped_model, optimizer, None
        state = hvd_sparse.create(args.method, framework="ddp", density=args.density,
                                  named_parameters=model.named_parameters(), **link(optimizer, args))
        wrapped_model.register_comm_hook(state, ddp.hook)
        return wrapped_model, optimizer, state

    def mean(self, value: float) -> float:
        tensor = torch.tensor(value)
        self.dist.all_reduce(tensor)
        return tensor.item() / self.size

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.dist.all_gather(out, tensor)
        return torch.stack(out)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """hvd_sparse's AdamW for a sparsified run on the Adam path; torch's for dense and --plain."""
    cls = torch.optim.AdamW if args.method == "dense" or args.plain else optim.AdamW
    return cls(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)


def link(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> dict:
    """The method's options: ``--option``s, and ``optimizer=`` unless ``--plain``."""
    return {**dict(args.option), **({} if args.plain else {"optimizer": optimizer})}


def held_out_loss(model: torch.nn.Module, data: np.ndarray) -> float:
    """Mean loss over ``EVAL_WINDOWS`` consecutive windows of the held-out bytes."""
    rows = data[: EVAL_WINDOWS * CONTEXT].astype(np.int64).reshape(EVAL_WINDOWS, CONTEXT)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=torch.from_numpy(rows), labels=torch.from_numpy(rows)).loss.item()
    model.train()
    return loss


def train(face, args: argparse.Namespace) -> dict:
    data = text_bytes()
    cut = int(data.size * (1 - HELD_OUT))
    train_data, held_data = data[:cut], data[cut:]
    model = gpt2(args.seed)
    numel = sum(p.numel() for p in model.parameters())
    module, optimizer, compressor = face.wrap(model, args)
    if face.rank == 0:
        print(f"{face.size} ranks, GPT-2 of {numel} parameters, {args.method}"
              f"{f' at density {args.density}' if compressor is not None else ''}", flush=True)
    losses, started = [], time.perf_counter()
    for step in range(args.steps):
        ids = batch(train_data, face.rank, step, args.batch_size, args.seed)
        optimizer.zero_grad()
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(face.mean(loss.item()))
        if face.rank == 0 and (step + 1) % args.log_every == 0:
            last = compressor.stats() if compressor is not None else {"density_actual": 1.0}
            print(f"step {step + 1:5d}  loss {np.mean(losses[-args.log_every:]):.4f}  "
                  f"density {last['density_actual']:.4f}", flush=True)
    seconds = time.perf_counter() - started
    stats = compressor.stats() if compressor is not None else {}
    dense_bytes = args.steps * numel * 4
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if not bool((face.gather(weights) == weights).all()):
        raise SystemExit("ranks hold different weights: synchronization failed")
    return {"method": args.method, "density": args.density if compressor is not None else 1.0,
            "options": dict(args.option),
            "adam_path": compressor is not None and not args.plain, "face": args.face,
            "ranks": face.size, "steps": args.steps, "parameters": numel,
            "losses": losses, "train_loss": float(np.mean(losses[-args.tail:])),
            "held_out_loss": held_out_loss(model, held_data),
            "bytes_sent": stats.get("bytes_sent_total", dense_bytes),
            "dense_bytes": stats.get("dense_bytes_total", dense_bytes), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="exdyna", choices=["dense", *hvd_sparse.available()])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--option", type=option, action="append", default=[], metavar="KEY=VALUE",
                        help="a method option, e.g. threshold_scaling=tracking (repeatable)")
    parser.add_argument("--plain", action="store_true",
                        help="torch's AdamW on the sparse average, without the Adam path (for comparison)")
    parser.add_argument("--face", choices=["auto", "ddp", "horovod"], default="auto",
                        help="auto: ddp under torchrun, horovod otherwise")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--tail", type=int, default=10, help="steps in the final training loss")
    parser.add_argument("--out", type=Path, default=None, help="save the result as JSON")
    args = parser.parse_args()
    if args.face == "auto":
        args.face = "ddp" if "TORCHELASTIC_RUN_ID" in os.environ else "horovod"
    face = DDP() if args.face == "ddp" else Horovod()
    result = train(face, args)
    if face.rank == 0:
        print(f"done: weights identical on all {face.size} ranks; training loss {result['train_loss']:.4f} "
              f"(last {args.tail} steps), held-out loss {result['held_out_loss']:.4f}, sent "
              f"{result['bytes_sent'] / result['dense_bytes']:.3f} x dense's bytes, "
              f"{result['seconds']:.1f} s", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
