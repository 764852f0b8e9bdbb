//! What training reports as it goes, and the renderers that show it.

use serde::Serialize;

use crate::render::{display, Chart, Composer, DisplayHandle, Progress, Render, Series};

/// One event of a training run. Computation emits these; renderers consume them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TrainEvent {
    /// An optimizer step is done (or skipped on an inf/NaN gradient under AMP).
    Step(StepReport),
    /// A pass over the validation batches.
    Eval(EvalReport),
    /// An epoch is done.
    Epoch(EpochReport),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    pub epoch: usize,
    /// Optimizer steps taken so far, this one included (skipped ones count).
    pub step: u64,
    /// Mean loss over the step's micro-batches (unscaled).
    pub loss: f32,
    /// Share of the step's samples classified right.
    pub accuracy: f64,
    pub samples: usize,
    pub seconds: f64,
    pub images_per_second: f64,
    pub learning_rate: f64,
    /// The loss scale the step used, under mixed precision.
    pub loss_scale: Option<f64>,
    /// Whether the optimizer step was skipped (inf/NaN gradients).
    pub skipped: bool,
    /// The gradients' global L2 norm before clipping, when clipping is on.
    pub grad_norm: Option<f64>,
    /// The norm of the gradients the optimizer then got, measured after clipping.
    pub applied_grad_norm: Option<f64>,
    pub memory: Option<MemorySample>,
}

/// Host memory around a step, when the process can measure it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemorySample {
    /// Bytes in use after the step.
    pub in_use: u64,
    /// Highest bytes in use during the step.
    pub peak: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalReport {
    pub epoch: usize,
    pub loss: f32,
    /// Correct predictions: of the samples, or of the pixels for segmentation.
    pub accuracy: f64,
    pub samples: usize,
    /// Segmentation only: each class's intersection over union across the
    /// whole set (`None` for a class neither predicted nor labelled anywhere).
    pub iou: Vec<Option<f64>>,
    /// Segmentation only: the pixels each class labels across the set.
    pub labelled: Vec<u64>,
}

impl EvalReport {
    /// The mean IoU over the classes present, for segmentation.
    pub fn mean_iou(&self) -> Option<f64> {
        let present: Vec<f64> = self.iou.iter().flatten().copied().collect();
        (!present.is_empty()).then(|| present.iter().sum::<f64>() / present.len() as f64)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochReport {
    pub epoch: usize,
    pub loss: f32,
    pub accuracy: f64,
    pub seconds: f64,
    pub images_per_second: f64,
}

/// Everything a run emitted, in order: what the notebook plots afterwards.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct History {
    pub events: Vec<TrainEvent>,
}

impl History {
    pub fn steps(&self) -> impl Iterator<Item = &StepReport> {
        self.events.iter().filter_map(|e| match e {
            TrainEvent::Step(s) => Some(s),
            _ => None,
        })
    }

    pub fn evals(&self) -> impl Iterator<Item = &EvalReport> {
        self.events.iter().filter_map(|e| match e {
            TrainEvent::Eval(e) => Some(e),
            _ => None,
        })
    }

    pub fn epochs(&self) -> impl Iterator<Item = &EpochReport> {
        self.events.iter().filter_map(|e| match e {
            TrainEvent::Epoch(e) => Some(e),
            _ => None,
        })
    }

    /// The last validation accuracy, if the run evaluated.
    pub fn final_accuracy(&self) -> Option<f64> {
        self.evals().last().map(|e| e.accuracy)
    }
}

/// A progress bar over a run's steps: live in a notebook (the kernel's
/// display updates), a carriage-return line in a terminal.
#[derive(Debug)]
pub struct ProgressView {
    bar: Progress,
}

impl ProgressView {
    pub fn new(label: impl Into<String>, total_steps: u64) -> Self {
        ProgressView { bar: Progress::new(label, total_steps) }
    }

    pub fn on_event(&mut self, event: &TrainEvent) {
        match event {
            TrainEvent::Step(s) => {
                let mut message =
                    format!("epoch {} loss {:.4} acc {:.1}% {:.1} img/s", s.epoch + 1, s.loss, s.accuracy * 100.0, s.images_per_second);
                if let Some(scale) = s.loss_scale {
                    message.push_str(&format!(" scale {scale}"));
                }
                if s.skipped {
                    message.push_str(" (skipped: inf/NaN)");
                }
                if let Some(memory) = s.memory {
                    message.push_str(&format!(" mem {} peak {}", crate::units::human(memory.in_use), crate::units::human(memory.peak)));
                }
                self.bar.set_message(message);
                self.bar.set(s.step);
            }
            TrainEvent::Eval(e) => {
                let iou = e.mean_iou().map(|iou| format!(" mIoU {:.1}%", iou * 100.0)).unwrap_or_default();
                self.bar.set_message(format!("epoch {} val loss {:.4} val acc {:.1}%{iou}", e.epoch + 1, e.loss, e.accuracy * 100.0))
            }
            TrainEvent::Epoch(_) => {}
        }
    }

    pub fn finish(&mut self) {
        self.bar.finish();
    }
}

/// Loss and accuracy charts that redraw in place as a run trains (once per
/// epoch): the training loss of every step beside the validation loss, and
/// each epoch's training and validation accuracy against reference lines.
#[derive(Debug)]
pub struct LiveCurves {
    title: String,
    step_losses: Vec<(f64, f64)>,
    val_losses: Vec<(f64, f64)>,
    train_accuracy: Vec<(f64, f64)>,
    val_accuracy: Vec<(f64, f64)>,
    references: Vec<(String, f64)>,
    last_step: u64,
    handle: Option<DisplayHandle>,
}

impl LiveCurves {
    pub fn new(title: impl Into<String>) -> Self {
        LiveCurves {
            title: title.into(),
            step_losses: Vec::new(),
            val_losses: Vec::new(),
            train_accuracy: Vec::new(),
            val_accuracy: Vec::new(),
            references: Vec::new(),
            last_step: 0,
            handle: None,
        }
    }

    /// A horizontal line on the accuracy chart (a baseline's accuracy, as a fraction).
    pub fn reference(mut self, name: impl Into<String>, accuracy: f64) -> Self {
        self.references.push((name.into(), accuracy));
        self
    }

    pub fn on_event(&mut self, event: &TrainEvent) {
        match event {
            TrainEvent::Step(s) => {
                self.last_step = s.step;
                if s.loss.is_finite() {
                    self.step_losses.push((s.step as f64, s.loss as f64));
                }
            }
            TrainEvent::Epoch(e) => self.train_accuracy.push(((e.epoch + 1) as f64, 100.0 * e.accuracy)),
            TrainEvent::Eval(e) => {
                self.val_losses.push((self.last_step as f64, e.loss as f64));
                self.val_accuracy.push(((e.epoch + 1) as f64, 100.0 * e.accuracy));
                self.draw();
            }
        }
    }

    /// Draws the last state (for a run without validation, whose epochs never redraw).
    pub fn finish(&mut self) {
        self.draw();
    }

    fn draw(&mut self) {
        let bundle = self.bundle();
        match &self.handle {
            Some(handle) => handle.update(&bundle),
            None => self.handle = Some(display(&bundle)),
        }
    }

    pub fn loss_chart(&self) -> Chart {
        Chart::new(format!("{}: loss", self.title))
            .x_label("optimizer step")
            .y_label("cross-entropy")
            .series(Series::line("train (each step)", self.step_losses.iter().copied()))
            .series(Series::line("validation", self.val_losses.iter().copied()))
    }

    pub fn accuracy_chart(&self) -> Chart {
        let mut chart = Chart::new(format!("{}: accuracy", self.title))
            .x_label("epoch")
            .y_label("%")
            .series(Series::line("train", self.train_accuracy.iter().copied()))
            .series(Series::line("validation", self.val_accuracy.iter().copied()));
        for (name, accuracy) in &self.references {
            chart = chart.series(Series::limit(name.clone(), 100.0 * accuracy));
        }
        chart
    }

    fn summary(&self) -> String {
        let last = |points: &[(f64, f64)]| points.last().map_or("-".to_owned(), |p| format!("{:.1}%", p.1));
        format!(
            "{}: {} epochs, {} steps; last train accuracy {}, validation accuracy {}",
            self.title,
            self.train_accuracy.len(),
            self.last_step,
            last(&self.train_accuracy),
            last(&self.val_accuracy)
        )
    }
}

impl Render for LiveCurves {
    fn bundle(&self) -> crate::render::Bundle {
        let charts = Composer::new().html_only(&self.loss_chart().bundle()).html_only(&self.accuracy_chart().bundle()).finish();
        charts.with("text/plain", self.summary())
    }
}
