//! Train/validation splits: stratified by class, grouped by plant, and
//! stratified group k-fold.

use std::collections::BTreeMap;

use rand::seq::SliceRandom;

use super::{rng_for, DataError};

/// Sample indices of each side, sorted.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Split {
    pub train: Vec<usize>,
    pub val: Vec<usize>,
}

fn check_fraction(val_fraction: f64) -> Result<(), DataError> {
    if val_fraction > 0.0 && val_fraction < 1.0 {
        Ok(())
    } else {
        Err(DataError::invalid("split", format!("the validation fraction must be between 0 and 1, got {val_fraction}")))
    }
}

/// Each class split on its own (as `train_test_split(..., stratify=labels)`):
/// round(n_c x fraction) of class c to validation, at least one when the class has two or more.
pub fn stratified_split(labels: &[u32], val_fraction: f64, seed: u64) -> Result<Split, DataError> {
    check_fraction(val_fraction)?;
    let mut by_class: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, &l) in labels.iter().enumerate() {
        by_class.entry(l).or_default().push(i);
    }
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (class, mut members) in by_class {
        members.shuffle(&mut rng_for(seed, 1, class as u64));
        let n = members.len();
        let mut take = (n as f64 * val_fraction).round() as usize;
        if n >= 2 {
            take = take.clamp(1, n - 1);
        }
        val.extend_from_slice(&members[..take]);
        train.extend_from_slice(&members[take..]);
    }
    train.sort_unstable();
    val.sort_unstable();
    Ok(Split { train, val })
}

/// Whole groups (plants) to one side, aiming at `val_fraction` of the
/// samples with class shares close to the whole set's: fold 0 of
/// [`stratified_group_kfold`] with round(1 / fraction) folds, then every
/// class put on both sides. A fold holds only some of a rare class's
/// plants, so fold 0 alone can leave such a class out of validation: a class
/// with two or more plants gets the plant nearest its validation share moved
/// over. A class of one plant cannot be on both sides; it goes to training,
/// since a class never trained on cannot be recognised.
pub fn group_split(labels: &[u32], groups: &[u64], val_fraction: f64, seed: u64) -> Result<Split, DataError> {
    check_fraction(val_fraction)?;
    let k = (1.0 / val_fraction).round().max(2.0) as usize;
    let mut folds = stratified_group_kfold(labels, groups, k, seed)?;
    let fold = folds.swap_remove(0);
    Ok(place_every_class(labels, groups, fold, val_fraction))
}

/// Each plant's photos per class, and which side it is on.
struct Plant {
    photos: BTreeMap<u32, usize>,
    in_val: bool,
}

fn place_every_class(labels: &[u32], groups: &[u64], split: Split, val_fraction: f64) -> Split {
    let mut plants: BTreeMap<u64, Plant> = BTreeMap::new();
    for (indices, in_val) in [(&split.train, false), (&split.val, true)] {
        for &i in indices {
            *plants.entry(groups[i]).or_insert_with(|| Plant { photos: BTreeMap::new(), in_val }).photos.entry(labels[i]).or_default() += 1;
        }
    }
    let classes: std::collections::BTreeSet<u32> = labels.iter().copied().collect();
    let plants_of = |plants: &BTreeMap<u64, Plant>, class: u32, in_val: bool| -> Vec<u64> {
        plants.iter().filter(|(_, p)| p.in_val == in_val && p.photos.contains_key(&class)).map(|(&g, _)| g).collect()
    };
    // A move may not take away the last plant of another class on the side it leaves.
    let safe_to_move = |plants: &BTreeMap<u64, Plant>, plant: u64, class: u32| {
        let from_val = plants[&plant].in_val;
        plants[&plant].photos.keys().filter(|&&other| other != class).all(|&other| plants_of(plants, other, from_val).len() > 1)
    };
    for &class in &classes {
        let in_train = plants_of(&plants, class, false);
        let in_val = plants_of(&plants, class, true);
        let photos: usize = plants.values().filter_map(|p| p.photos.get(&class)).sum();
        let moving = match (in_train.len(), in_val.len()) {
            (0, 1) => Some((in_val, photos)),
            (n, 0) if n >= 2 => Some((in_train, ((photos as f64 * val_fraction).round() as usize).max(1))),
            (0, n) if n >= 2 => Some((in_val, ((photos as f64 * (1.0 - val_fraction)).round() as usize).max(1))),
            _ => None,
        };
        let Some((candidates, wanted)) = moving else { continue };
        let chosen = candidates
            .into_iter()
            .filter(|&g| safe_to_move(&plants, g, class))
            .min_by_key(|&g| (plants[&g].photos[&class].abs_diff(wanted), g));
        if let Some(g) = chosen {
            let plant = plants.get_mut(&g).expect("a candidate is a plant");
            plant.in_val = !plant.in_val;
        }
    }
    let (val, train): (Vec<usize>, Vec<usize>) = (0..labels.len()).partition(|&i| plants[&groups[i]].in_val);
    Split { train, val }
}

/// k folds; no group in two folds; each fold's class shares near the whole
/// set's. scikit-learn's StratifiedGroupKFold method: groups in a shuffled
/// order, most class-skewed first, each to the fold that keeps the per-class
/// spread across folds smallest.
pub fn stratified_group_kfold(labels: &[u32], groups: &[u64], k: usize, seed: u64) -> Result<Vec<Split>, DataError> {
    if labels.len() != groups.len() {
        return Err(DataError::invalid("split", format!("{} labels but {} group ids", labels.len(), groups.len())));
    }
    let classes = labels.iter().max().map_or(0, |&m| m as usize + 1);
    let mut members: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, &g) in groups.iter().enumerate() {
        members.entry(g).or_default().push(i);
    }
    if k < 2 || members.len() < k {
        return Err(DataError::invalid(
            "split",
            format!("{k} folds need at least 2 folds and {k} groups; there are {} groups", members.len()),
        ));
    }
    let mut class_totals = vec![0f64; classes];
    for &l in labels {
        class_totals[l as usize] += 1.0;
    }
    let mut group_list: Vec<(u64, Vec<f64>)> = members
        .iter()
        .map(|(&g, idx)| {
            let mut counts = vec![0f64; classes];
            for &i in idx {
                counts[labels[i] as usize] += 1.0;
            }
            (g, counts)
        })
        .collect();
    group_list.shuffle(&mut rng_for(seed, 2, 0));
    let spread = |counts: &[f64]| {
        let n = counts.len() as f64;
        let mean = counts.iter().sum::<f64>() / n;
        (counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / n).sqrt()
    };
    // Stable sort keeps the shuffled order among equally skewed groups.
    group_list.sort_by(|a, b| spread(&b.1).total_cmp(&spread(&a.1)));
    let mut fold_counts = vec![vec![0f64; classes]; k];
    let mut fold_of: BTreeMap<u64, usize> = BTreeMap::new();
    for (g, counts) in &group_list {
        let mut best: Option<(f64, f64, usize)> = None;
        for fold in 0..k {
            let size: f64 = fold_counts[fold].iter().sum();
            for c in 0..classes {
                fold_counts[fold][c] += counts[c];
            }
            let cost: f64 = (0..classes)
                .filter(|&c| class_totals[c] > 0.0)
                .map(|c| spread(&fold_counts.iter().map(|f| f[c] / class_totals[c]).collect::<Vec<_>>()))
                .sum();
            for c in 0..classes {
                fold_counts[fold][c] -= counts[c];
            }
            // Ties go to the smaller fold, then the lower index.
            let better = best.is_none_or(|(b_cost, b_size, _)| cost < b_cost - 1e-12 || ((cost - b_cost).abs() <= 1e-12 && size < b_size));
            if better {
                best = Some((cost, size, fold));
            }
        }
        let chosen = best.map_or(0, |b| b.2);
        for c in 0..classes {
            fold_counts[chosen][c] += counts[c];
        }
        fold_of.insert(*g, chosen);
    }
    Ok((0..k)
        .map(|fold| {
            let (val, train): (Vec<usize>, Vec<usize>) = (0..labels.len()).partition(|&i| fold_of[&groups[i]] == fold);
            Split { train, val }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// 12 imbalanced classes, plants of 1-5 photos each.
    fn plants() -> (Vec<u32>, Vec<u64>) {
        let (mut labels, mut groups) = (Vec::new(), Vec::new());
        let mut plant = 0u64;
        for class in 0..12u32 {
            let photos = 240 / (class as usize + 1);
            let mut left = photos;
            while left > 0 {
                let n = (1 + (plant as usize * 7) % 5).min(left);
                for _ in 0..n {
                    labels.push(class);
                    groups.push(plant);
                }
                left -= n;
                plant += 1;
            }
        }
        (labels, groups)
    }

    fn share(indices: &[usize], labels: &[u32], class: u32) -> f64 {
        indices.iter().filter(|&&i| labels[i] == class).count() as f64 / indices.len() as f64
    }

    #[test]
    fn stratified_split_keeps_every_class_share() {
        let (labels, _) = plants();
        let split = stratified_split(&labels, 0.2, 42).unwrap();
        assert_eq!(split.train.len() + split.val.len(), labels.len());
        assert!(split.train.iter().all(|i| !split.val.contains(i)));
        for class in 0..12u32 {
            let n = labels.iter().filter(|&&l| l == class).count();
            let in_val = split.val.iter().filter(|&&i| labels[i] == class).count();
            assert_eq!(in_val, ((n as f64 * 0.2).round() as usize).max(1), "class {class}");
        }
        assert_eq!(split, stratified_split(&labels, 0.2, 42).unwrap());
        assert_ne!(split, stratified_split(&labels, 0.2, 7).unwrap());
        assert!(stratified_split(&labels, 1.0, 0).is_err());
    }

    #[test]
    fn group_split_puts_no_plant_on_both_sides_and_stays_near_the_shares() {
        let (labels, groups) = plants();
        let split = group_split(&labels, &groups, 0.2, 42).unwrap();
        let train_groups: HashSet<u64> = split.train.iter().map(|&i| groups[i]).collect();
        assert!(split.val.iter().all(|&i| !train_groups.contains(&groups[i])), "a plant leaked");
        let fraction = split.val.len() as f64 / labels.len() as f64;
        assert!((0.15..0.25).contains(&fraction), "{fraction}");
        for class in 0..12u32 {
            let whole = share(&(0..labels.len()).collect::<Vec<_>>(), &labels, class);
            assert!((share(&split.val, &labels, class) - whole).abs() < 0.05, "class {class}");
        }
    }

    #[test]
    fn group_split_validates_every_class_of_two_plants_or_more_and_trains_a_class_of_one() {
        // Classes 0-2 have 40 plants; class 3 has three and class 4 two (rarer
        // than the five folds, so fold 0 alone misses one of them); class 5 one.
        let (mut labels, mut groups) = (Vec::new(), Vec::new());
        let mut plant = 0u64;
        for (class, plants) in [(0u32, 40), (1, 40), (2, 40), (3, 3), (4, 2), (5, 1)] {
            for _ in 0..plants {
                for _ in 0..3 {
                    labels.push(class);
                    groups.push(plant);
                }
                plant += 1;
            }
        }
        for seed in 0..20 {
            let split = group_split(&labels, &groups, 0.2, seed).unwrap();
            let train_groups: HashSet<u64> = split.train.iter().map(|&i| groups[i]).collect();
            assert!(split.val.iter().all(|&i| !train_groups.contains(&groups[i])), "seed {seed}: a plant leaked");
            assert_eq!(split.train.len() + split.val.len(), labels.len());
            for class in 0..5u32 {
                assert!(split.val.iter().any(|&i| labels[i] == class), "seed {seed}: class {class} has no validation photo");
                assert!(split.train.iter().any(|&i| labels[i] == class), "seed {seed}: class {class} has no training photo");
            }
            assert!(split.train.iter().filter(|&&i| labels[i] == 5).count() == 3, "seed {seed}: the one-plant class is trained on");
        }
        let missed = (0..20u64).filter(|&seed| {
            let fold = stratified_group_kfold(&labels, &groups, 5, seed).unwrap().swap_remove(0);
            (3..5u32).any(|class| !fold.val.iter().any(|&i| labels[i] == class))
        });
        assert!(missed.count() > 0, "fold 0 alone always placed the rare classes, so the test shows nothing");
    }

    #[test]
    fn five_folds_partition_the_set_without_leakage_and_with_strata() {
        let (labels, groups) = plants();
        let folds = stratified_group_kfold(&labels, &groups, 5, 3).unwrap();
        let mut seen = vec![0; labels.len()];
        for fold in &folds {
            for &i in &fold.val {
                seen[i] += 1;
            }
            assert_eq!(fold.train.len() + fold.val.len(), labels.len());
            let val_groups: HashSet<u64> = fold.val.iter().map(|&i| groups[i]).collect();
            assert!(fold.train.iter().all(|&i| !val_groups.contains(&groups[i])), "a plant leaked");
            let size = fold.val.len() as f64 / labels.len() as f64;
            assert!((0.16..0.24).contains(&size), "fold size {size}");
            for class in 0..12u32 {
                let n = labels.iter().filter(|&&l| l == class).count() as f64;
                let in_val = fold.val.iter().filter(|&&i| labels[i] == class).count() as f64;
                assert!((in_val / n - 0.2).abs() < 0.1, "class {class}: {in_val} of {n}");
            }
        }
        assert!(seen.iter().all(|&s| s == 1), "every sample is validated exactly once");
        assert!(stratified_group_kfold(&labels, &groups[1..], 5, 0).is_err());
        assert!(stratified_group_kfold(&[0, 1], &[1, 2], 5, 0).is_err());
    }

    #[test]
    fn random_group_assignment_would_leak_which_is_what_the_test_catches() {
        let (labels, groups) = plants();
        let split = stratified_split(&labels, 0.2, 42).unwrap();
        let train_groups: HashSet<u64> = split.train.iter().map(|&i| groups[i]).collect();
        assert!(split.val.iter().any(|&i| train_groups.contains(&groups[i])));
    }
}
