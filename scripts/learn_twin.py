"""`vramlab train`'s run in PyTorch: the same folder, model sizes and recipe, for
telling a model that cannot learn a dataset from an implementation that cannot.

Trains torchvision's model (for `vit-tiny` and `vit-small` its `VisionTransformer`
with our sizes, as scripts/bench_saved.py builds it) on an ImageFolder written by
`vramlab synth`: every photo resized to RES x RES once (aspect not kept, as our
`Transforms::resize`), a random horizontal flip each epoch, ImageNet's
normalisation, batch 32, AdamW or Adam, optionally annealed on a cosine per
step, the last short batch dropped. The split is drawn as ours is, not the same
photos: per class, whole plants (the manifest's `group`) held out until 20% of
the class's photos are. Prints each epoch's training and validation accuracy
and the majority class's, and writes them as JSON.

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/learn_twin.py --root /tmp/leaves --model vit-tiny \
        --res 64 --epochs 30 --opt adamw --lr 0.0003 --cosine
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import pathlib
import random
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def reexec_in_bench_venv() -> None:
    venv = pathlib.Path(os.environ.get("VRAMLAB_BENCH_VENV", ROOT / ".venv-bench"))
    python = venv / "bin" / "python"
    if pathlib.Path(sys.prefix).resolve() != venv.resolve():
        if not python.exists():
            sys.exit(f"no PyTorch venv at {venv}: run scripts/bench_train.py once, or set VRAMLAB_BENCH_VENV")
        os.execv(python, [str(python), *sys.argv])


def split(rows: list[dict], val_share: float, seed: int) -> tuple[list[dict], list[dict]]:
    by_class: dict[str, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for row in rows:
        by_class[row["class"]][row["group"]].append(row)
    rng = random.Random(seed)
    train, val = [], []
    for plants in by_class.values():
        groups = sorted(plants)
        rng.shuffle(groups)
        wanted = val_share * sum(len(photos) for photos in plants.values())
        held = 0
        for group in groups:
            if held < wanted:
                val += plants[group]
                held += len(plants[group])
            else:
                train += plants[group]
    return train, val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=pathlib.Path, required=True, help="an ImageFolder with vramlab synth's manifest.csv")
    parser.add_argument("--model", default="vit-tiny", choices=["vit-tiny", "vit-small", "resnet18"])
    parser.add_argument("--res", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--opt", default="adamw", choices=["adam", "adamw"])
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--cosine", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "target" / "learn_twin.json")
    args = parser.parse_args()
    reexec_in_bench_venv()

    import torch
    from PIL import Image

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_saved import torch_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    with open(args.root / "manifest.csv") as manifest:
        rows = list(csv.DictReader(manifest))
    classes = sorted({row["class"] for row in rows})
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def load(photos: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        images = []
        for row in photos:
            with Image.open(args.root / row["path"]) as image:
                image.draft("RGB", (args.res, args.res))
                pixels = image.convert("RGB").resize((args.res, args.res), Image.BILINEAR)
            images.append((torch.frombuffer(bytearray(pixels.tobytes()), dtype=torch.uint8)
                           .view(args.res, args.res, 3).permute(2, 0, 1).float() / 255 - mean) / std)
        return torch.stack(images), torch.tensor([classes.index(row["class"]) for row in photos])

    train_rows, val_rows = split(rows, 0.2, args.seed)
    started = time.perf_counter()
    (x_train, y_train), (x_val, y_val) = load(train_rows), load(val_rows)
    print(f"{len(train_rows)} train / {len(val_rows)} val photos at {args.res}x{args.res}, decoded in "
          f"{time.perf_counter() - started:.0f} s")
    majority = collections.Counter(y_train.tolist()).most_common(1)[0][0]
    majority_acc = (y_val == majority).float().mean().item()

    model = torch_model(args.model, args.res, len(classes))
    optimizer = (torch.optim.AdamW if args.opt == "adamw" else torch.optim.Adam)(model.parameters(), lr=args.lr)
    steps_per_epoch = len(x_train) // args.batch
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * steps_per_epoch) if args.cosine else None
    epochs = []
    print("epoch  train loss  train acc  val loss  val acc  seconds")
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        model.train()
        order = torch.randperm(len(x_train))
        losses, correct = [], 0
        for step in range(steps_per_epoch):
            index = order[step * args.batch:(step + 1) * args.batch]
            flip = torch.rand(len(index)) < 0.5
            images = torch.where(flip.view(-1, 1, 1, 1), x_train[index].flip(3), x_train[index])
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, y_train[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if schedule:
                schedule.step()
            losses.append(loss.item())
            correct += (logits.argmax(1) == y_train[index]).sum().item()
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(x_val[i:i + 64]) for i in range(0, len(x_val), 64)])
        record = {
            "epoch": epoch,
            "train_loss": sum(losses) / len(losses),
            "train_acc": correct / (steps_per_epoch * args.batch),
            "val_loss": torch.nn.functional.cross_entropy(logits, y_val).item(),
            "val_acc": (logits.argmax(1) == y_val).float().mean().item(),
            "seconds": time.perf_counter() - started,
        }
        epochs.append(record)
        print(f"{epoch:5d}  {record['train_loss']:10.3f}  {record['train_acc']:8.0%}  {record['val_loss']:8.3f}  "
              f"{record['val_acc']:6.0%}  {record['seconds']:7.1f}", flush=True)
    print(f"{args.model} in PyTorch at {args.res}x{args.res}, {args.epochs} epochs: val accuracy "
          f"{epochs[-1]['val_acc']:.1%} (best {max(e['val_acc'] for e in epochs):.1%}); majority class {majority_acc:.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch_version = torch.__version__
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch_version, "commit": commit,
                                    "train": len(train_rows), "val": len(val_rows), "majority": majority_acc,
                                    "epochs": epochs}, indent=1))


if __name__ == "__main__":
    main()
