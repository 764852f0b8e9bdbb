//! A floor for learnability: multinomial logistic regression on colour
//! (chromaticity) histograms. It sees colours only, not the shape or size of lesions, so
//! what it cannot separate needs a convolutional model.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{loss, ops, Optimizer};
use rayon::prelude::*;

use super::decode::{decode_file, DecodeOptions, Decoder, RgbImage};
use super::folder::ImageFolder;
use super::split::Split;
use super::DataError;

/// Bins of the chromaticity histogram: 8 x 8 over r = R/(R+G+B), g = G/(R+G+B).
pub const HISTOGRAM_BINS: usize = 64;

/// Square roots of the pixel shares in 8 x 8 chromaticity bins. Chromaticity
/// ignores brightness (the lighting varies); the square root lifts the small
/// bins where lesions fall.
pub fn colour_histogram(image: &RgbImage) -> Vec<f32> {
    let mut bins = vec![0f32; HISTOGRAM_BINS];
    for p in image.pixels().chunks_exact(3) {
        let sum = (p[0] as u32 + p[1] as u32 + p[2] as u32).max(1) as f32;
        let bin = |v: u8| ((v as f32 / sum * 8.0) as usize).min(7);
        bins[bin(p[0]) * 8 + bin(p[1])] += 1.0;
    }
    let n = (image.pixels().len() / 3).max(1) as f32;
    bins.iter_mut().for_each(|b| *b = (*b / n).sqrt());
    bins
}

/// Accuracy of the histogram baseline on a split.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BaselineReport {
    pub train_accuracy: f64,
    pub val_accuracy: f64,
    /// Validation accuracy per class (NaN for a class absent from validation).
    pub per_class: Vec<f64>,
    /// Accuracy of always answering the most frequent training class.
    pub majority_accuracy: f64,
    pub train_images: usize,
    pub val_images: usize,
}

fn tensor_err(op: &'static str) -> impl Fn(candle_core::Error) -> DataError {
    move |source| DataError::Tensor { op, shape: Vec::new(), source }
}

/// Trains on `split.train` and evaluates on `split.val` of `folder`
/// (400 full-batch AdamW steps on standardised histograms).
pub fn histogram_baseline(folder: &ImageFolder, split: &Split) -> Result<BaselineReport, DataError> {
    let options = DecodeOptions { decoder: Decoder::TurboJpeg, min_short_side: Some(64) };
    let features: Vec<Vec<f32>> = folder
        .items
        .par_iter()
        .map(|item| decode_file(&item.path, options).map(|d| colour_histogram(&d.image)))
        .collect::<Result<_, _>>()?;
    let classes = folder.classes.len();
    let labels = folder.labels();
    let gather = |idx: &[usize]| -> Result<(Tensor, Tensor), DataError> {
        let x: Vec<f32> = idx.iter().flat_map(|&i| features[i].iter().copied()).collect();
        let y: Vec<u32> = idx.iter().map(|&i| labels[i]).collect();
        Ok((
            Tensor::from_vec(x, (idx.len(), HISTOGRAM_BINS), &Device::Cpu).map_err(tensor_err("baseline features"))?,
            Tensor::from_vec(y, idx.len(), &Device::Cpu).map_err(tensor_err("baseline labels"))?,
        ))
    };
    if split.train.is_empty() || split.val.is_empty() {
        return Err(DataError::invalid("histogram_baseline", "train and validation both need images"));
    }
    let (xt, yt) = gather(&split.train)?;
    let (xv, yv) = gather(&split.val)?;
    let run = || -> candle_core::Result<(f64, f64, Vec<f64>)> {
        let mean = xt.mean_keepdim(0)?;
        let std = (xt.broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)? + 1e-6)?.sqrt()?;
        let norm = |x: &Tensor| x.broadcast_sub(&mean)?.broadcast_div(&std);
        let (xt, xv) = (norm(&xt)?, norm(&xv)?);
        let w = Var::zeros((HISTOGRAM_BINS, classes), DType::F32, &Device::Cpu)?;
        let b = Var::zeros(classes, DType::F32, &Device::Cpu)?;
        let params = candle_nn::ParamsAdamW { lr: 0.05, weight_decay: 1e-3, ..Default::default() };
        let mut opt = candle_nn::AdamW::new(vec![w.clone(), b.clone()], params)?;
        let logits = |x: &Tensor| x.matmul(w.as_tensor())?.broadcast_add(b.as_tensor());
        for _ in 0..400 {
            let l = loss::cross_entropy(&logits(&xt)?, &yt)?;
            opt.backward_step(&l)?;
        }
        let accuracy = |x: &Tensor, y: &Tensor| -> candle_core::Result<(f64, Vec<u32>)> {
            let pred = ops::softmax_last_dim(&logits(x)?)?.argmax(1)?;
            let hits = pred.eq(y)?.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()? as f64;
            Ok((hits, pred.to_vec1::<u32>()?))
        };
        let (train_acc, _) = accuracy(&xt, &yt)?;
        let (val_acc, pred) = accuracy(&xv, &yv)?;
        let truth = yv.to_vec1::<u32>()?;
        let per_class = (0..classes as u32)
            .map(|c| {
                let of_c: Vec<usize> = (0..truth.len()).filter(|&i| truth[i] == c).collect();
                if of_c.is_empty() {
                    f64::NAN
                } else {
                    of_c.iter().filter(|&&i| pred[i] == c).count() as f64 / of_c.len() as f64
                }
            })
            .collect();
        Ok((train_acc, val_acc, per_class))
    };
    let (train_accuracy, val_accuracy, per_class) = run().map_err(tensor_err("training the histogram baseline"))?;
    let mut counts = vec![0usize; classes];
    for &i in &split.train {
        counts[labels[i] as usize] += 1;
    }
    let majority = counts.iter().enumerate().max_by_key(|(_, &n)| n).map_or(0, |(c, _)| c) as u32;
    let majority_accuracy = split.val.iter().filter(|&&i| labels[i] == majority).count() as f64 / split.val.len() as f64;
    Ok(BaselineReport {
        train_accuracy,
        val_accuracy,
        per_class,
        majority_accuracy,
        train_images: split.train.len(),
        val_images: split.val.len(),
    })
}
