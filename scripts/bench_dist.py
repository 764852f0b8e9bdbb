"""Data-parallel step time: vramlab on MPI against PyTorch DDP on gloo, on this machine, in one run.

Each configuration runs, alternated several times so that both see the same machine state:
- vramlab, 2 ranks: `mpirun -np 2 vramlab bench train ... --cards 2 --json`, one thread a rank;
- PyTorch, 2 ranks: DDP on gloo (torch.multiprocessing, 25 MiB buckets, its defaults), one thread a rank;
- each alone: 1 process of 1 thread on the same per-rank batch (vramlab's `bench train`, PyTorch without DDP).
Both sides train the same model (torchvision's, or the ViT and U-Net twins of scripts/bench_train.py)
with SGD momentum 0.9 on random images. A step's time on 2 ranks is the slower rank's median; the
scaling is the samples a second of 2 ranks over those of 1. Neither side binds its processes to cores.

    VRAMLAB_BENCH_VENV=.venv-bench python3 scripts/bench_dist.py [--rounds 3] [--steps 5] [--configs resnet18:16:64]

Before each round it waits for a quiet machine and records the load, as bench_train.py does.
Prints a table and writes JSON with every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import (  # noqa: E402
    OTHERS_BUSY_LIMIT, ROOT, TORCH_MODELS, VIT_SIZES, OthersMeter, bench_python, classes_of, config_spec, vramlab_binary,
    wait_for_quiet, write_report,
)

CONFIGS = [
    {"model": "resnet18", "batch": 16, "res": 64},
    {"model": "vit-tiny", "batch": 8, "res": 64},
]
RANKS = 2

TORCH_DDP = r"""
import json, os, statistics, sys, time
import torch, torchvision
import torch.distributed as dist
import torch.multiprocessing as mp

def build(cfg):
    torch.manual_seed(0)
    if cfg["torch_model"] == "unet":
        sys.path.insert(0, cfg["scripts"])
        from unet_twin import UNet
        return UNet(classes=cfg["classes"])
    if cfg["vit"]:
        dim, depth, heads, mlp = cfg["vit"]
        return torchvision.models.VisionTransformer(image_size=cfg["res"], patch_size=16, num_layers=depth, num_heads=heads,
                                                    hidden_dim=dim, mlp_dim=mlp, num_classes=cfg["classes"])
    return getattr(torchvision.models, cfg["torch_model"])(num_classes=cfg["classes"])

def run(rank, cfg, results):
    torch.set_num_threads(1)
    ranks = cfg["ranks"]
    model = build(cfg)
    if ranks > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(cfg["port"]))
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        model = torch.nn.parallel.DistributedDataParallel(model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1 + rank)
    x = torch.randn(cfg["batch"], 3, cfg["res"], cfg["res"])
    shape = (cfg["batch"], cfg["res"], cfg["res"]) if cfg["torch_model"] == "unet" else (cfg["batch"],)
    y = torch.randint(0, cfg["classes"], shape)
    loss_fn = torch.nn.CrossEntropyLoss()
    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    for _ in range(cfg["warmup"]):
        step()
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter(); step(); times.append(time.perf_counter() - t)
    results[rank] = statistics.median(times)
    if ranks > 1:
        dist.destroy_process_group()

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    if cfg["ranks"] == 1:
        results = {}
        run(0, cfg, results)
    else:
        results = mp.Manager().dict()
        mp.spawn(run, args=(cfg, results), nprocs=cfg["ranks"], join=True)
    print(json.dumps({"rank_medians": [results[r] for r in range(cfg["ranks"])], "torch": torch.__version__}))
"""


def ours(binary: pathlib.Path, cfg: dict, steps: int, warmup: int, ranks: int) -> list[float]:
    """Each rank's median step, in seconds."""
    args = [str(binary), "bench", "train", "--model", cfg["model"], "--batch", str(cfg["batch"]), "--res", str(cfg["res"]),
            "--classes", str(classes_of(cfg)), "--opt", "sgd-momentum", "--steps", str(steps), "--warmup", str(warmup), "--json"]
    env = dict(os.environ, RAYON_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if ranks == 1:
        out = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
        return [json.loads(out.stdout)["median_seconds"]]
    launch = ["mpirun", "-np", str(ranks), "--bind-to", "none", "-x", "RAYON_NUM_THREADS"]
    out = subprocess.run(launch + args + ["--cards", str(ranks)], check=True, capture_output=True, text=True, env=env)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [line["result"]["median_seconds"] for line in sorted(lines, key=lambda line: line["rank"])]


def theirs(python: pathlib.Path, cfg: dict, steps: int, warmup: int, ranks: int, port: int) -> tuple[list[float], str]:
    payload = {"torch_model": TORCH_MODELS[cfg["model"]], "vit": VIT_SIZES.get(cfg["model"]), "batch": cfg["batch"], "res": cfg["res"],
               "classes": classes_of(cfg), "scripts": str(ROOT / "scripts"), "steps": steps, "warmup": warmup, "ranks": ranks,
               "port": port}
    script = ROOT / "target" / "bench_dist_torch.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(TORCH_DDP)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([str(python), str(script), json.dumps(payload)], check=True, capture_output=True, text=True, env=env)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return found["rank_medians"], found["torch"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--configs", nargs="+", type=config_spec, metavar="MODEL:BATCH:RES",
                        help="only these configurations, each rank's batch (default: " +
                             ", ".join(f"{c['model']}:{c['batch']}:{c['res']}" for c in CONFIGS) + ")")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds to wait for a quiet machine before a round")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "target" / "bench_dist.json")
    args = parser.parse_args()
    python, binary = bench_python(), vramlab_binary()
    results = []
    port = 29500 + os.getpid() % 1000
    for cfg in args.configs or CONFIGS:
        samples = {"ours_2": [], "torch_2": [], "ours_1": [], "torch_1": []}
        rounds, torch_version = [], None
        for _ in range(args.rounds):
            before = wait_for_quiet(args.settle)
            with OthersMeter() as others:
                samples["ours_2"].append(max(ours(binary, cfg, args.steps, args.warmup, RANKS)))
                torch_2, torch_version = theirs(python, cfg, args.steps, args.warmup, RANKS, port)
                samples["torch_2"].append(max(torch_2))
                samples["ours_1"].append(ours(binary, cfg, args.steps, args.warmup, 1)[0])
                samples["torch_1"].append(theirs(python, cfg, args.steps, args.warmup, 1, port)[0][0])
            rounds.append(dict(before, others_share=round(others.share, 3)))
        quiet = all(r["quiet"] and r["others_share"] < OTHERS_BUSY_LIMIT for r in rounds)
        medians = {k: statistics.median(v) for k, v in samples.items()}
        row = dict(cfg, ranks=RANKS, threads_per_rank=1, **{f"{k}_s": v for k, v in medians.items()}, samples=samples,
                   rounds=rounds, quiet=quiet, torch=torch_version)
        row["ratio_2"] = medians["ours_2"] / medians["torch_2"] if quiet else None
        row["ratio_1"] = medians["ours_1"] / medians["torch_1"] if quiet else None
        row["scaling_ours"] = RANKS * medians["ours_1"] / medians["ours_2"]
        row["scaling_torch"] = RANKS * medians["torch_1"] / medians["torch_2"]
        results.append(row)
        loads = ", ".join(f"{r['load_1min']:.2f}" for r in rounds)
        verdict = f"ratio {row['ratio_2']:.2f}x on 2 ranks, {row['ratio_1']:.2f}x alone" if quiet else "busy: no ratio"
        print(f"{cfg['model']} b{cfg['batch']}@{cfg['res']} a rank: vramlab {medians['ours_2']:.3f} s on {RANKS} ranks "
              f"({medians['ours_1']:.3f} s alone, scaling {row['scaling_ours']:.2f}x), PyTorch {torch_version} DDP "
              f"{medians['torch_2']:.3f} s ({medians['torch_1']:.3f} s alone, scaling {row['scaling_torch']:.2f}x): {verdict} "
              f"(load before each round: {loads}; others' share during: {max(r['others_share'] for r in rounds):.1%} at most)",
              flush=True)
    write_report(args.out, rounds=args.rounds, steps=args.steps, warmup=args.warmup, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
