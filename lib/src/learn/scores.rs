//! The report of a training run from a folder, as tables.

use crate::data::Symptom;
use crate::render::{Bundle, Render, Table};
use crate::units::percent_of_one;

use super::LearnReport;

impl LearnReport {
    /// Validation accuracy per class, the baselines beside it, and the overall figures in the title.
    pub fn table(&self) -> Table {
        let c = &self.config;
        let baseline = self.baseline.as_ref().map(|b| format!(", colour histogram {:.1}%", 100.0 * b.val_accuracy)).unwrap_or_default();
        let mut table = Table::new(["class", "symptom", "val photos", "accuracy", "colour histogram"])
            .title(format!(
                "{} at {}x{}{}, {} epochs: val accuracy {:.1}% (balanced {:.1}%; majority class {:.1}%{baseline}); {} train / {} val photos",
                c.model.as_str(),
                c.res,
                c.res,
                self.levers(),
                c.epochs,
                100.0 * self.val_accuracy,
                100.0 * self.balanced_accuracy,
                100.0 * self.majority_accuracy,
                self.train_images,
                self.val_images
            ))
            .right_align(&[2, 3, 4]);
        for s in &self.per_class {
            table.push_row([
                s.class.clone(),
                s.symptom.map_or("-", Symptom::as_str).to_owned(),
                s.val_images.to_string(),
                percent_of_one(s.accuracy),
                percent_of_one(s.baseline_accuracy),
            ]);
        }
        let groups: Vec<String> = [Symptom::Healthy, Symptom::Spots, Symptom::Blotches, Symptom::Discolouration]
            .into_iter()
            .filter_map(|g| self.symptom_accuracy(g).map(|(n, acc)| format!("{} {:.0}% of {n}", g.as_str(), 100.0 * acc)))
            .collect();
        if !groups.is_empty() {
            table = table.note(format!("By symptom: {}.", groups.join(", ")));
        }
        table
    }

    /// The levers pulled, as ", f16 mixed precision, 2 x 16 accumulated"; empty for none.
    fn levers(&self) -> String {
        let c = &self.config;
        let mut levers = String::new();
        if c.precision != crate::models::Precision::F32 {
            levers.push_str(&format!(", {}", c.precision));
        }
        if c.accumulation > 1 {
            levers.push_str(&format!(", {} x {} accumulated", c.accumulation, c.batch_size));
        }
        levers
    }

    /// Loss and accuracy per epoch, training side and validation side.
    pub fn epoch_table(&self) -> Table {
        let mut table = Table::new(["epoch", "train loss", "train acc", "val loss", "val acc", "seconds"]).right_align(&[0, 1, 2, 3, 4, 5]);
        for e in &self.epochs {
            table.push_row([
                (e.epoch + 1).to_string(),
                format!("{:.3}", e.train_loss),
                percent_of_one(Some(e.train_accuracy)),
                format!("{:.3}", e.val_loss),
                percent_of_one(Some(e.val_accuracy)),
                format!("{:.1}", e.seconds),
            ]);
        }
        table
    }

    /// Validation photos by true class (rows) and predicted class (columns,
    /// numbered as the rows), with the most frequent confusions in a note.
    pub fn confusion_table(&self) -> Table {
        let classes: Vec<&str> = self.per_class.iter().map(|s| s.class.as_str()).collect();
        let columns = std::iter::once("true \\ predicted".to_owned()).chain((0..classes.len()).map(|c| c.to_string()));
        let mut table = Table::new(columns)
            .title(format!("confusion matrix: {} validation photos, {:.1}% on the diagonal", self.val_images, 100.0 * self.val_accuracy))
            .right_align(&(1..=classes.len()).collect::<Vec<_>>());
        let mut confusions = Vec::new();
        for (t, row) in self.confusion.iter().enumerate() {
            table.push_row(std::iter::once(format!("{t} {}", classes[t])).chain(row.iter().map(|&n| {
                if n == 0 {
                    ".".to_owned()
                } else {
                    n.to_string()
                }
            })));
            confusions.extend(row.iter().enumerate().filter(|&(p, &n)| p != t && n > 0).map(|(p, &n)| (n, t, p)));
        }
        confusions.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let top: Vec<String> =
            confusions.iter().take(4).map(|&(n, t, p)| format!("{} taken for {} {n} times", classes[t], classes[p])).collect();
        if !top.is_empty() {
            table = table.note(format!("Most confused: {}.", top.join("; ")));
        }
        table
    }

    /// Shows the per-class table in a notebook cell's result.
    pub fn evcxr_display(&self) {
        self.bundle().print_as_cell_result();
    }
}

impl Render for LearnReport {
    fn bundle(&self) -> Bundle {
        self.table().bundle()
    }
}
