"""The PyTorch twin of vramlab's `unet`: a small U-Net for segmentation (2
classes, background and lesion) written as nested levels, so that its
state-dict names are the ones vramlab's files carry:

    inc.0.weight, inc.1.running_mean, ...      the first double convolution
    down1.conv.3.weight                        level 1: pool, double convolution
    down1.down2.down3.up.weight                the innermost level's upsampling
    down1.down2.fuse.4.bias                    level 2's fusion of skip and upsampled map
    outc.weight, outc.bias                     the 1x1 classifier

Level l (1-based) halves the resolution, works at CHANNELS[l], runs level l+1
inside itself when there is one, upsamples back to CHANNELS[l-1] with a
transposed convolution and fuses the skip with the upsampled map (skip first).
The logits are N x classes x H x W; the loss is the per-pixel cross-entropy,
`F.cross_entropy(logits, labels)` with int64 labels N x H x W, the mean over
every pixel; the metric is each class's IoU.

    python3 scripts/unet_twin.py [--classes 2]

prints the parameter count and every state-dict entry.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CHANNELS = (16, 32, 64, 128)
CLASSES = 2


def double_conv(cin: int, cout: int) -> nn.Sequential:
    # Biases off: each convolution is followed by batch-norm, whose shift subsumes one.
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class Level(nn.Module):
    def __init__(self, level: int, channels=CHANNELS):
        super().__init__()
        c, c_next = channels[level - 1], channels[level]
        self.inner_name = f"down{level + 1}" if level + 1 < len(channels) else None
        # Registration order is state-dict order: pool, conv, the inner level, up, fuse.
        self.pool = nn.MaxPool2d(2)
        self.conv = double_conv(c, c_next)
        if self.inner_name is not None:
            setattr(self, self.inner_name, Level(level + 1, channels))
        self.up = nn.ConvTranspose2d(c_next, c, 2, stride=2)
        self.fuse = double_conv(2 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.pool(x))
        if self.inner_name is not None:
            y = getattr(self, self.inner_name)(y)
        y = self.up(y)
        return self.fuse(torch.cat([x, y], dim=1))


class UNet(nn.Module):
    def __init__(self, classes: int = CLASSES, channels=CHANNELS):
        super().__init__()
        self.inc = double_conv(3, channels[0])
        self.down1 = Level(1, channels)
        self.outc = nn.Conv2d(channels[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outc(self.down1(self.inc(x)))


def parameter_count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def iou(logits: torch.Tensor, labels: torch.Tensor, classes: int = CLASSES) -> list[float]:
    """Each class's intersection over union of the predicted and the true
    masks (NaN for a class absent from both)."""
    predicted = logits.argmax(dim=1)
    scores = []
    for c in range(classes):
        p, t = predicted == c, labels == c
        union = (p | t).sum().item()
        scores.append((p & t).sum().item() / union if union else float("nan"))
    return scores


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=CLASSES)
    args = parser.parse_args()
    net = UNet(classes=args.classes)
    for name, t in net.state_dict().items():
        print(f"{name} {list(t.shape)}")
    print(f"UNet(classes={args.classes}, channels={CHANNELS}): {parameter_count(net):,} parameters")


if __name__ == "__main__":
    main()
