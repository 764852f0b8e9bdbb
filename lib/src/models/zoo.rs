use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use super::{efficientnet, resnet, small_cnn, unet, vit, ModelError, ModelSpec};

/// The models of the zoo, by the names the magics and the CLI accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelName {
    Resnet18,
    Resnet34,
    Resnet50,
    EfficientnetB0,
    SmallCnn,
    VitTiny,
    VitSmall,
    Unet,
}

impl ModelName {
    pub const ALL: [ModelName; 8] = [
        ModelName::Resnet18,
        ModelName::Resnet34,
        ModelName::Resnet50,
        ModelName::EfficientnetB0,
        ModelName::SmallCnn,
        ModelName::VitTiny,
        ModelName::VitSmall,
        ModelName::Unet,
    ];

    /// The canonical spelling (`resnet50`, `efficientnet-b0`, `small-cnn`).
    pub fn as_str(self) -> &'static str {
        match self {
            ModelName::Resnet18 => "resnet18",
            ModelName::Resnet34 => "resnet34",
            ModelName::Resnet50 => "resnet50",
            ModelName::EfficientnetB0 => "efficientnet-b0",
            ModelName::SmallCnn => "small-cnn",
            ModelName::VitTiny => "vit-tiny",
            ModelName::VitSmall => "vit-small",
            ModelName::Unet => "unet",
        }
    }

    /// The layer list for `num_classes` outputs.
    pub fn spec(self, num_classes: usize) -> ModelSpec {
        match self {
            ModelName::Resnet18 => resnet::resnet18(num_classes),
            ModelName::Resnet34 => resnet::resnet34(num_classes),
            ModelName::Resnet50 => resnet::resnet50(num_classes),
            ModelName::EfficientnetB0 => efficientnet::efficientnet_b0(num_classes),
            ModelName::SmallCnn => small_cnn::small_cnn(num_classes),
            ModelName::VitTiny => vit::vit_tiny(num_classes),
            ModelName::VitSmall => vit::vit_small(num_classes),
            ModelName::Unet => unet::unet(num_classes),
        }
    }

    /// Whether the model labels each pixel (its logits are a map).
    pub fn segments(self) -> bool {
        self == ModelName::Unet
    }

    /// The classes a summary or a fit check assumes when none are given:
    /// ImageNet's 1000 for a classifier, background and lesion for the U-Net.
    pub fn default_classes(self) -> usize {
        if self.segments() {
            2
        } else {
            1000
        }
    }

    /// Valid names, comma-separated, for error messages.
    pub fn valid_names() -> String {
        ModelName::ALL.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")
    }
}

impl FromStr for ModelName {
    type Err = ModelError;

    /// Accepts any case and `-`/`_` or nothing between words (`EfficientNet_B0`, `smallcnn`).
    fn from_str(text: &str) -> Result<Self, ModelError> {
        let key: String = text.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect();
        ModelName::ALL
            .into_iter()
            .find(|m| m.as_str().replace('-', "") == key)
            .ok_or_else(|| ModelError::UnknownModel { name: text.to_owned(), valid: ModelName::valid_names() })
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A zoo model by name, for `num_classes` outputs.
pub fn model(name: &str, num_classes: usize) -> Result<ModelSpec, ModelError> {
    super::limits::check(name, "classes", num_classes, super::MAX_CLASSES)?;
    if num_classes == 0 {
        return Err(ModelError::NoClasses { model: name.to_owned() });
    }
    Ok(name.parse::<ModelName>()?.spec(num_classes))
}
