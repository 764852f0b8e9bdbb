//! Timing of `vramlab::ops` against candle's own operations, on the CPU:
//! each case forward only and forward + backward (gradients of input and
//! weight), median of the repeats after one warm-up. Attention is timed
//! against the same computation composed of candle's operations, once per
//! [`AttentionKeeps`]; the linear layer against candle-nn's `Linear`
//! (`matmul`, then `broadcast_add`), input, weight and bias trainable; a
//! U-Net's up-convolution against candle's `conv_transpose2d`, then
//! `broadcast_add`, the same three trainable.
//! Prints JSON (seconds);
//! scripts/bench_ops.py runs PyTorch on the same cases and adds the ratios.
//!
//!     cargo bench -p vramlab --bench ops [-- --repeats N] [--only NAME] [--ours-only]

use std::time::Instant;

use vramlab::candle::{DType, Device, Tensor, Var, D};
use vramlab::candle_nn::{Linear, Module};
use vramlab::ops::{attention, conv2d, conv_transpose2d, linear, max_pool2d, AttentionKeeps, ConvParams};

fn p50(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn time(repeats: usize, mut f: impl FnMut()) -> f64 {
    f();
    p50((0..repeats)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed().as_secs_f64()
        })
        .collect())
}

/// Forward, and forward + backward of `sum(op(x, w))`, with `x` and `w` both trainable.
fn fwd_and_bwd(repeats: usize, x: &Tensor, w: &Tensor, op: impl Fn(&Tensor, &Tensor) -> Tensor) -> serde_json::Value {
    let (xv, wv) = (Var::from_tensor(x).expect("var"), Var::from_tensor(w).expect("var"));
    let forward = time(repeats, || {
        op(x, w);
    });
    let train = time(repeats, || {
        op(xv.as_tensor(), wv.as_tensor()).sum_all().expect("sum").backward().expect("backward");
    });
    serde_json::json!({"fwd_s": forward, "fwd_bwd_s": train})
}

fn randn(dims: &[usize], dtype: DType) -> Tensor {
    Tensor::randn(0f32, 1f32, dims, &Device::Cpu).expect("randn").to_dtype(dtype).expect("dtype")
}

struct Conv {
    name: &'static str,
    batch: usize,
    channels: usize,
    out_channels: usize,
    size: usize,
    kernel: usize,
    params: ConvParams,
}

const CONVS: [Conv; 15] = [
    Conv {
        name: "conv3x3_64_64_32x32_b32",
        batch: 32,
        channels: 64,
        out_channels: 64,
        size: 32,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv7x7s2_3_64_224x224_b8",
        batch: 8,
        channels: 3,
        out_channels: 64,
        size: 224,
        kernel: 7,
        params: ConvParams { stride: 2, padding: 3, groups: 1 },
    },
    Conv {
        name: "conv3x3_256_256_4x4_b32",
        batch: 32,
        channels: 256,
        out_channels: 256,
        size: 4,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_512_512_2x2_b32",
        batch: 32,
        channels: 512,
        out_channels: 512,
        size: 2,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "dwconv3x3_96_56x56_b8",
        batch: 8,
        channels: 96,
        out_channels: 96,
        size: 56,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 96 },
    },
    Conv {
        name: "conv3x3_64_64_56x56_b8",
        batch: 8,
        channels: 64,
        out_channels: 64,
        size: 56,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_128_128_28x28_b8",
        batch: 8,
        channels: 128,
        out_channels: 128,
        size: 28,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_256_256_14x14_b8",
        batch: 8,
        channels: 256,
        out_channels: 256,
        size: 14,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_512_512_7x7_b8",
        batch: 8,
        channels: 512,
        out_channels: 512,
        size: 7,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    // ResNet18 b32@64's layer1 and layer2.
    Conv {
        name: "conv3x3_64_64_16x16_b32",
        batch: 32,
        channels: 64,
        out_channels: 64,
        size: 16,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_128_128_8x8_b32",
        batch: 32,
        channels: 128,
        out_channels: 128,
        size: 8,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    // The U-Net b16@64's levels: narrow maps, where the per-plane transforms weigh more than the products.
    Conv {
        name: "conv3x3_16_16_64x64_b16",
        batch: 16,
        channels: 16,
        out_channels: 16,
        size: 64,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_32_32_32x32_b16",
        batch: 16,
        channels: 32,
        out_channels: 32,
        size: 32,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_64_64_16x16_b16",
        batch: 16,
        channels: 64,
        out_channels: 64,
        size: 16,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
    Conv {
        name: "conv3x3_128_128_8x8_b16",
        batch: 16,
        channels: 128,
        out_channels: 128,
        size: 8,
        kernel: 3,
        params: ConvParams { stride: 1, padding: 1, groups: 1 },
    },
];

/// `(name, batch, tokens, dim, heads)`: ViT-Tiny's attention at 224 and 384 pixels.
const ATTENTIONS: [(&str, usize, usize, usize, usize); 2] =
    [("attention_vit_tiny_224_b32", 32, 197, 192, 3), ("attention_vit_tiny_384_b32", 32, 577, 192, 3)];

/// Attention from candle's operations: what autograd of a plain model computes.
fn candle_attention(qkv: &Tensor, heads: usize) -> Tensor {
    let (b, n, width) = qkv.dims3().expect("dims");
    let (d, dh) = (width / 3, width / 3 / heads);
    let parts = qkv.reshape((b, n, 3, heads, dh)).and_then(|t| t.permute((2, 0, 3, 1, 4))).expect("heads");
    let part = |i: usize| parts.get(i).and_then(|t| t.contiguous()).expect("part");
    let (q, k, v) = (part(0), part(1), part(2));
    let scores = (q.matmul(&k.t().expect("t")).expect("matmul") * (1.0 / (dh as f64).sqrt())).expect("scale");
    let max = scores.max_keepdim(D::Minus1).expect("max").detach();
    let exp = scores.broadcast_sub(&max).and_then(|t| t.exp()).expect("exp");
    let probabilities = exp.broadcast_div(&exp.sum_keepdim(D::Minus1).expect("sum")).expect("div");
    probabilities.matmul(&v).and_then(|t| t.transpose(1, 2)).and_then(|t| t.reshape((b, n, d))).expect("output")
}

/// Forward, and forward + backward of `sum(op(qkv))`.
fn attention_times(repeats: usize, qkv: &Tensor, op: impl Fn(&Tensor) -> Tensor) -> serde_json::Value {
    let var = Var::from_tensor(qkv).expect("var");
    let forward = time(repeats, || {
        op(qkv);
    });
    let train = time(repeats, || {
        op(var.as_tensor()).sum_all().expect("sum").backward().expect("backward");
    });
    serde_json::json!({"fwd_s": forward, "fwd_bwd_s": train})
}

/// `(name, leading dims of x, in features, out features)`: ViT-Tiny's MLP up
/// and down on a batch of 32 at 224 pixels, and a classifier head.
const LINEARS: [(&str, &[usize], usize, usize); 3] = [
    ("linear_vit_tiny_mlp_up_b32", &[32, 197], 192, 768),
    ("linear_vit_tiny_mlp_down_b32", &[32, 197], 768, 192),
    ("linear_head_512_1000_b32", &[32], 512, 1000),
];

/// Forward, and forward + backward of `sum(op(x, w, b))`, all three trainable.
fn biased_times(repeats: usize, [x, w, b]: &[Tensor; 3], op: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor) -> serde_json::Value {
    let [xv, wv, bv] = [x, w, b].map(|t| Var::from_tensor(t).expect("var"));
    let forward = time(repeats, || {
        op(x, w, b);
    });
    let train = time(repeats, || {
        op(xv.as_tensor(), wv.as_tensor(), bv.as_tensor()).sum_all().expect("sum").backward().expect("backward");
    });
    serde_json::json!({"fwd_s": forward, "fwd_bwd_s": train})
}

/// `(name, batch, channels, size, out channels)`, kernel and stride 2: a
/// U-Net's deepest up-convolution (8x8 -> 16x16) and a shallow one (32x32 -> 64x64).
const CONV_TRANSPOSES: [(&str, usize, usize, usize, usize); 2] =
    [("conv_transpose2x2_128_64_8x8_b8", 8, 128, 8, 64), ("conv_transpose2x2_32_16_32x32_b8", 8, 32, 32, 16)];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let repeats = args.iter().position(|a| a == "--repeats").and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(10);
    // `--only NAME` times the cases whose name contains NAME (for profiling one).
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned().unwrap_or_default();
    let with_candle = !args.iter().any(|a| a == "--ours-only");
    let mut report = serde_json::Map::new();
    for c in CONVS.iter().filter(|c| c.name.contains(&only)) {
        for dtype in [DType::F32, DType::F16] {
            let x = randn(&[c.batch, c.channels, c.size, c.size], dtype);
            let w = randn(&[c.out_channels, c.channels / c.params.groups, c.kernel, c.kernel], dtype);
            let p = c.params;
            let ours = fwd_and_bwd(repeats, &x, &w, |x, w| conv2d(x, w, p).expect("conv2d"));
            let candle_conv = |x: &Tensor, w: &Tensor| x.conv2d(w, p.padding, p.stride, 1, p.groups).expect("conv2d");
            // candle's f16 backward takes tens of seconds per step here: its forward alone is timed.
            let candle = if !with_candle {
                serde_json::Value::Null
            } else if dtype == DType::F32 {
                fwd_and_bwd(repeats, &x, &w, candle_conv)
            } else {
                serde_json::json!({"fwd_s": time(repeats, || { candle_conv(&x, &w); })})
            };
            report.insert(format!("{}_{dtype:?}", c.name).to_lowercase(), serde_json::json!({"ours": ours, "candle": candle}));
        }
    }
    if "maxpool3x3s2_64_32x32_b32".contains(&only) {
        // Max-pool 3x3 stride 2 has no backward in candle: only its forward (on a padded input) is timed.
        let x = randn(&[32, 64, 32, 32], DType::F32);
        let xv = Var::from_tensor(&x).expect("var");
        let ours_fwd = time(repeats, || {
            max_pool2d(&x, 3, 2, 1).expect("pool");
        });
        let ours_train = time(repeats, || {
            max_pool2d(xv.as_tensor(), 3, 2, 1).expect("pool").sum_all().expect("sum").backward().expect("backward");
        });
        let candle_fwd = time(repeats, || {
            x.pad_with_zeros(2, 1, 1).expect("pad").pad_with_zeros(3, 1, 1).expect("pad").max_pool2d_with_stride(3, 2).expect("pool");
        });
        report.insert(
            "maxpool3x3s2_64_32x32_b32_f32".into(),
            serde_json::json!({"ours": {"fwd_s": ours_fwd, "fwd_bwd_s": ours_train}, "candle": {"fwd_s": candle_fwd}}),
        );
    }
    for (name, batch, tokens, dim, heads) in ATTENTIONS.into_iter().filter(|a| a.0.contains(&only)) {
        let qkv = randn(&[batch, tokens, 3 * dim], DType::F32);
        let candle = if with_candle { attention_times(repeats, &qkv, |x| candle_attention(x, heads)) } else { serde_json::Value::Null };
        for keeps in [AttentionKeeps::Probabilities, AttentionKeeps::RowStatistics] {
            let ours = attention_times(repeats, &qkv, |x| attention(x, heads, keeps).expect("attention"));
            report.insert(format!("{name}_{keeps:?}_f32").to_lowercase(), serde_json::json!({"ours": ours, "candle": candle}));
        }
    }
    for (name, leading, inputs, outputs) in LINEARS.into_iter().filter(|l| l.0.contains(&only)) {
        let operands =
            [randn(&[leading, &[inputs]].concat(), DType::F32), randn(&[outputs, inputs], DType::F32), randn(&[outputs], DType::F32)];
        let ours = biased_times(repeats, &operands, |x, w, b| linear(x, w, Some(b)).expect("linear"));
        let candle_linear = |x: &Tensor, w: &Tensor, b: &Tensor| Linear::new(w.clone(), Some(b.clone())).forward(x).expect("linear");
        let candle = if with_candle { biased_times(repeats, &operands, candle_linear) } else { serde_json::Value::Null };
        report.insert(format!("{name}_f32"), serde_json::json!({"ours": ours, "candle": candle}));
    }
    for (name, batch, channels, size, outputs) in CONV_TRANSPOSES.into_iter().filter(|c| c.0.contains(&only)) {
        let operands = [
            randn(&[batch, channels, size, size], DType::F32),
            randn(&[channels, outputs, 2, 2], DType::F32),
            randn(&[outputs], DType::F32),
        ];
        let ours = biased_times(repeats, &operands, |x, w, b| conv_transpose2d(x, w, Some(b), 2).expect("conv_transpose2d"));
        let candle_up = |x: &Tensor, w: &Tensor, b: &Tensor| {
            let y = x.conv_transpose2d(w, 0, 0, 2, 1).expect("conv_transpose2d");
            y.broadcast_add(&b.reshape((1, outputs, 1, 1)).expect("bias")).expect("add")
        };
        let candle = if with_candle { biased_times(repeats, &operands, candle_up) } else { serde_json::Value::Null };
        report.insert(format!("{name}_f32"), serde_json::json!({"ours": ours, "candle": candle}));
    }
    report.insert("repeats".into(), repeats.into());
    report.insert("threads".into(), vramlab::candle::utils::get_num_threads().into());
    println!("{}", serde_json::to_string_pretty(&report).expect("json"));
}
