//! Batch-level MixUp and CutMix on whatever device the batch is on. Inputs
//! are detached first: mixing is data preparation, never part of the graph.

use candle_core::Tensor;
use rand::seq::SliceRandom;
use rand::Rng as _;
use rand_distr::{Beta, Distribution};

use super::{DataError, Rng};

/// A mixed batch: images, soft targets (N x classes) and the mixing weight
/// of the original images.
#[derive(Debug, Clone)]
pub struct Mixed {
    pub images: Tensor,
    pub targets: Tensor,
    pub lambda: f64,
    /// Which sample each one was mixed with.
    pub partner: Vec<u32>,
}

fn tensor_err<'a>(op: &'static str, t: &'a Tensor) -> impl FnOnce(candle_core::Error) -> DataError + 'a {
    move |source| DataError::Tensor { op, shape: t.dims().to_vec(), source }
}

/// `labels` (N, u32) as N x `classes` f32 rows of 0 and 1.
pub fn one_hot(labels: &Tensor, classes: usize) -> Result<Tensor, DataError> {
    let n = labels.dims1().map_err(tensor_err("one_hot", labels))?;
    let ids = labels.to_vec1::<u32>().map_err(tensor_err("one_hot", labels))?;
    let mut rows = vec![0f32; n * classes];
    for (i, &id) in ids.iter().enumerate() {
        if id as usize >= classes {
            return Err(DataError::invalid("one_hot", format!("label {id} at row {i} is not below {classes} classes")));
        }
        rows[i * classes + id as usize] = 1.0;
    }
    Tensor::from_vec(rows, (n, classes), labels.device()).map_err(tensor_err("one_hot", labels))
}

fn draw(images: &Tensor, alpha: f64, rng: &mut Rng) -> Result<(usize, f64, Vec<u32>), DataError> {
    let (n, _, _, _) = images.dims4().map_err(tensor_err("mix", images))?;
    let beta = Beta::new(alpha, alpha).map_err(|e| DataError::invalid("mix", format!("alpha {alpha}: {e}")))?;
    let lambda = beta.sample(rng);
    let mut partner: Vec<u32> = (0..n as u32).collect();
    partner.shuffle(rng);
    Ok((n, lambda, partner))
}

fn mix_targets(labels: &Tensor, classes: usize, partner: &Tensor, lambda: f64) -> Result<Tensor, DataError> {
    let hot = one_hot(labels, classes)?;
    let other = hot.index_select(partner, 0).map_err(tensor_err("mix targets", &hot))?;
    let mixed = ((&hot * lambda).and_then(|a| (other * (1.0 - lambda)).and_then(|b| a + b))).map_err(tensor_err("mix targets", &hot))?;
    Ok(mixed)
}

/// MixUp: x = lambda x_i + (1 - lambda) x_j with lambda ~ Beta(alpha, alpha) and j a permutation.
pub fn mixup(images: &Tensor, labels: &Tensor, classes: usize, alpha: f64, rng: &mut Rng) -> Result<Mixed, DataError> {
    let images = images.detach();
    let (_, lambda, partner) = draw(&images, alpha, rng)?;
    let index = Tensor::new(partner.as_slice(), images.device()).map_err(tensor_err("mixup", &images))?;
    let other = images.index_select(&index, 0).map_err(tensor_err("mixup", &images))?;
    let mixed = ((&images * lambda).and_then(|a| (other * (1.0 - lambda)).and_then(|b| a + b))).map_err(tensor_err("mixup", &images))?;
    let targets = mix_targets(labels, classes, &index, lambda)?;
    Ok(Mixed { images: mixed, targets, lambda, partner })
}

/// CutMix: a box of area share (1 - lambda) pasted from the partner image;
/// lambda is corrected to the box actually pasted after clipping at the border.
pub fn cutmix(images: &Tensor, labels: &Tensor, classes: usize, alpha: f64, rng: &mut Rng) -> Result<Mixed, DataError> {
    let images = images.detach();
    let (_, _, h, w) = images.dims4().map_err(tensor_err("cutmix", &images))?;
    let (_, lambda, partner) = draw(&images, alpha, rng)?;
    let cut = (1.0 - lambda).sqrt();
    let (cw, ch) = ((w as f64 * cut) as usize, (h as f64 * cut) as usize);
    let (cx, cy) = (rng.random_range(0..w), rng.random_range(0..h));
    let (x0, x1) = (cx.saturating_sub(cw / 2), (cx + cw / 2).min(w));
    let (y0, y1) = (cy.saturating_sub(ch / 2), (cy + ch / 2).min(h));
    let mut mask = vec![0f32; h * w];
    for y in y0..y1 {
        mask[y * w + x0..y * w + x1].fill(1.0);
    }
    let lambda = 1.0 - ((x1 - x0) * (y1 - y0)) as f64 / (w * h) as f64;
    let device = images.device();
    let index = Tensor::new(partner.as_slice(), device).map_err(tensor_err("cutmix", &images))?;
    let mixed = (|| {
        let mask = Tensor::from_vec(mask, (1, 1, h, w), device)?.to_dtype(images.dtype())?;
        let keep = (mask.ones_like()? - &mask)?;
        let other = images.index_select(&index, 0)?;
        images.broadcast_mul(&keep)? + other.broadcast_mul(&mask)?
    })()
    .map_err(tensor_err("cutmix", &images))?;
    let targets = mix_targets(labels, classes, &index, lambda)?;
    Ok(Mixed { images: mixed, targets, lambda, partner })
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::data::rng_for;

    fn row_sums(targets: &Tensor) -> Result<Vec<f32>, DataError> {
        targets.to_dtype(DType::F32).and_then(|t| t.sum(1)).and_then(|t| t.to_vec1::<f32>()).map_err(tensor_err("row sums", targets))
    }

    fn batch() -> (Tensor, Tensor) {
        let n = 4;
        let data: Vec<f32> = (0..n).flat_map(|i| vec![i as f32; 3 * 8 * 8]).collect();
        let images = Tensor::from_vec(data, (n, 3, 8, 8), &Device::Cpu).unwrap();
        let labels = Tensor::new(&[0u32, 1, 2, 3], &Device::Cpu).unwrap();
        (images, labels)
    }

    #[test]
    fn mixup_blends_images_and_targets_with_one_lambda() {
        let (images, labels) = batch();
        let mixed = mixup(&images, &labels, 5, 0.4, &mut rng_for(1, 0, 0)).unwrap();
        let lam = mixed.lambda;
        assert_eq!(mixed.images.dims(), &[4, 3, 8, 8]);
        let first = mixed.images.get(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
        let j = mixed.partner[0] as f64;
        assert!((first as f64 - (lam * 0.0 + (1.0 - lam) * j)).abs() < 1e-5);
        for s in row_sums(&mixed.targets).unwrap() {
            assert!((s - 1.0).abs() < 1e-5);
        }
        let t0 = mixed.targets.get(0).unwrap().to_vec1::<f32>().unwrap();
        if mixed.partner[0] != 0 {
            assert!((t0[0] as f64 - lam).abs() < 1e-5);
        }
    }

    #[test]
    fn cutmix_pastes_a_box_and_lambda_matches_its_area() {
        let (images, labels) = batch();
        for seed in 0..8 {
            let mixed = cutmix(&images, &labels, 4, 1.0, &mut rng_for(seed, 0, 0)).unwrap();
            let j = mixed.partner[0] as f32;
            let first: Vec<f32> = mixed.images.get(0).unwrap().get(0).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let pasted = first.iter().filter(|&&v| v == j && j != 0.0).count();
            if j != 0.0 {
                assert!((1.0 - pasted as f64 / 64.0 - mixed.lambda).abs() < 1e-9, "seed {seed}");
            }
            assert!(first.iter().all(|&v| v == 0.0 || v == j));
        }
    }

    #[test]
    fn mixing_a_variable_stays_outside_autograd() {
        let (images, labels) = batch();
        let var = Var::from_tensor(&images).unwrap();
        let mixed = mixup(var.as_tensor(), &labels, 4, 0.2, &mut rng_for(2, 0, 0)).unwrap();
        let grads = mixed.images.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(var.as_tensor()).is_none());
    }

    #[test]
    fn bad_labels_and_alpha_are_errors() {
        let (images, labels) = batch();
        assert!(one_hot(&labels, 3).unwrap_err().to_string().contains("label 3"));
        assert!(mixup(&images, &labels, 4, 0.0, &mut rng_for(0, 0, 0)).is_err());
    }
}
