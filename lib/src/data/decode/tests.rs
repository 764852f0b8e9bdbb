use std::path::Path;

use super::*;

/// A w x h image: left half `left`, right half `right`.
pub(crate) fn halves(w: u32, h: u32, left: [u8; 3], right: [u8; 3]) -> RgbImage {
    let pixels = (0..h).flat_map(|_| (0..w).flat_map(move |x| if x < w / 2 { left } else { right })).collect();
    RgbImage::new(w, h, pixels).unwrap()
}

pub(crate) fn jpeg(image: &RgbImage, quality: u8) -> Vec<u8> {
    let mut bytes = Vec::new();
    jpeg_encoder::Encoder::new(&mut bytes, quality)
        .encode(image.pixels(), image.width() as u16, image.height() as u16, jpeg_encoder::ColorType::Rgb)
        .unwrap();
    bytes
}

fn close(a: [u8; 3], b: [u8; 3], tolerance: i32) -> bool {
    (0..3).all(|c| (a[c] as i32 - b[c] as i32).abs() <= tolerance)
}

const RED: [u8; 3] = [220, 40, 30];
const BLUE: [u8; 3] = [30, 60, 200];

fn decode(bytes: &[u8], decoder: Decoder, min: Option<u32>) -> Decoded {
    decode_bytes(bytes, Path::new("mem.jpg"), DecodeOptions { decoder, min_short_side: min }).unwrap()
}

#[test]
fn both_decoders_read_a_jpeg_as_rgb() {
    let bytes = jpeg(&halves(32, 16, RED, BLUE), 95);
    for decoder in [Decoder::TurboJpeg, Decoder::Image] {
        let d = decode(&bytes, decoder, None);
        assert_eq!((d.image.width(), d.image.height(), d.dct_eighths), (32, 16, 8));
        assert!(close(d.image.pixel(3, 8), RED, 8), "{decoder:?} {:?}", d.image.pixel(3, 8));
        assert!(close(d.image.pixel(28, 8), BLUE, 8), "{decoder:?} {:?}", d.image.pixel(28, 8));
        assert_eq!(d.encoded_bytes, bytes.len());
    }
}

#[test]
fn dct_scaling_picks_the_smallest_scale_that_keeps_the_short_side() {
    let bytes = jpeg(&halves(256, 192, RED, BLUE), 90);
    let d = decode(&bytes, Decoder::TurboJpeg, Some(40));
    assert_eq!((d.image.width(), d.image.height(), d.dct_eighths), (64, 48, 2));
    assert_eq!(d.stored_size, (256, 192));
    assert_eq!(d.upright_size, (256, 192));
    assert!(close(d.image.pixel(5, 20), RED, 10));
    let d = decode(&bytes, Decoder::TurboJpeg, Some(100));
    assert_eq!((d.image.width(), d.image.height(), d.dct_eighths), (160, 120, 5), "5/8 covers 100, 4/8 gives 96");
    let d = decode(&bytes, Decoder::TurboJpeg, Some(200));
    assert_eq!(d.dct_eighths, 8);
    let d = decode(&bytes, Decoder::Image, Some(40));
    assert_eq!((d.image.width(), d.dct_eighths), (256, 8), "image never scales");
}

#[test]
fn the_chosen_scale_covers_the_short_side_and_is_the_smallest_that_does() {
    assert_eq!(dct_eighths(683, 512, Some(224)), 4);
    assert_eq!(dct_eighths(4000, 3000, Some(224)), 1);
    assert_eq!(dct_eighths(3000, 4000, Some(500)), 2);
    assert_eq!(dct_eighths(1024, 768, Some(224)), 3);
    assert_eq!(dct_eighths(224, 224, Some(224)), 8);
    assert_eq!(dct_eighths(100, 80, Some(224)), 8, "never upscales");
    assert_eq!(dct_eighths(4000, 3000, None), 8);
    for (w, h, min) in [(683, 512, 224), (4000, 3000, 224), (641, 479, 150), (1280, 853, 300), (17, 9, 2)] {
        let m = dct_eighths(w, h, Some(min)) as usize;
        let short = w.min(h) as usize;
        let scaled = |m: usize| ScalingFactor::new(m, 8).scale(short);
        assert!(scaled(m) >= min as usize, "{w}x{h} at {m}/8 gives {} < {min}", scaled(m));
        assert!(m == 1 || scaled(m - 1) < min as usize, "{w}x{h}: {}/8 would do", m - 1);
    }
}

#[test]
fn greyscale_jpeg_and_png_become_three_equal_channels() {
    let mut bytes = Vec::new();
    let luma: Vec<u8> = (0..64).map(|i| (i * 4) as u8).collect();
    jpeg_encoder::Encoder::new(&mut bytes, 100).encode(&luma, 8, 8, jpeg_encoder::ColorType::Luma).unwrap();
    for decoder in [Decoder::TurboJpeg, Decoder::Image] {
        let d = decode(&bytes, decoder, None);
        let p = d.image.pixel(5, 5);
        assert!(p[0] == p[1] && p[1] == p[2], "{p:?}");
    }
    let grey = image::GrayImage::from_raw(8, 8, luma).unwrap();
    let mut png = Vec::new();
    grey.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
    let d = decode(&png, Decoder::TurboJpeg, None);
    assert_eq!(d.image.pixel(1, 0), [4, 4, 4]);
}

#[test]
fn adobe_cmyk_jpeg_becomes_the_right_rgb() {
    // Written by Pillow from RGB (220,40,30) | (30,60,200): an inverted Adobe CMYK file, as Photoshop writes.
    let bytes = include_bytes!("../fixtures/cmyk.jpg");
    for decoder in [Decoder::TurboJpeg, Decoder::Image] {
        let d = decode(bytes, decoder, None);
        assert!(close(d.image.pixel(2, 4), RED, 12), "{decoder:?}: {:?}", d.image.pixel(2, 4));
        assert!(close(d.image.pixel(13, 4), BLUE, 12), "{decoder:?}: {:?}", d.image.pixel(13, 4));
    }
}

#[test]
fn alpha_is_composited_on_white() {
    let mut rgba = image::RgbaImage::new(2, 1);
    rgba.put_pixel(0, 0, image::Rgba([10, 20, 30, 255]));
    rgba.put_pixel(1, 0, image::Rgba([0, 0, 0, 0]));
    let mut png = Vec::new();
    rgba.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
    let d = decode(&png, Decoder::TurboJpeg, None);
    assert_eq!(d.image.pixel(0, 0), [10, 20, 30]);
    assert_eq!(d.image.pixel(1, 0), [255, 255, 255]);
}

#[test]
fn exif_orientation_turns_the_stored_pixels_upright() {
    let upright = halves(32, 16, RED, BLUE);
    // Orientation 6: the camera stored the scene turned 90 degrees anticlockwise.
    let stored = image::imageops::rotate270(&image::RgbImage::from_raw(32, 16, upright.pixels().to_vec()).unwrap());
    let mut bytes = Vec::new();
    let mut encoder = jpeg_encoder::Encoder::new(&mut bytes, 95);
    encoder.add_app_segment(1, crate::data::synth::exif_orientation(6)).unwrap();
    encoder.encode(stored.as_raw(), 16, 32, jpeg_encoder::ColorType::Rgb).unwrap();
    for decoder in [Decoder::TurboJpeg, Decoder::Image] {
        let d = decode(&bytes, decoder, None);
        assert_eq!((d.image.width(), d.image.height()), (32, 16), "{decoder:?}");
        assert_eq!(d.stored_size, (16, 32));
        assert_eq!(d.upright_size, (32, 16), "{decoder:?}");
        assert!(close(d.image.pixel(3, 8), RED, 10), "{decoder:?} {:?}", d.image.pixel(3, 8));
        assert!(close(d.image.pixel(28, 8), BLUE, 10));
    }
    let scaled = decode(&bytes, Decoder::TurboJpeg, Some(8));
    assert_eq!((scaled.image.width(), scaled.image.height(), scaled.dct_eighths), (16, 8, 4));
    assert_eq!(scaled.upright_size, (32, 16), "the full upright size, whatever the DCT scale");
}

#[test]
fn bgr_input_is_put_right_and_shows_why_it_matters() {
    let bgr = vec![30, 40, 220, 200, 60, 30];
    let image = RgbImage::from_bgr(2, 1, bgr.clone()).unwrap();
    assert_eq!(image.pixel(0, 0), RED);
    assert_eq!(image.pixel(1, 0), BLUE);
    let misread = RgbImage::new(2, 1, bgr).unwrap();
    assert_eq!(misread.pixel(0, 0), [30, 40, 220], "read as RGB, a red lesion turns blue");
}

#[test]
fn garbage_and_truncated_files_are_errors_naming_the_path() {
    for decoder in [Decoder::TurboJpeg, Decoder::Image] {
        let options = DecodeOptions { decoder, min_short_side: None };
        let err = decode_bytes(b"this is not an image", Path::new("leaf/notes.jpg"), options).unwrap_err();
        assert!(err.to_string().starts_with("decoding leaf/notes.jpg"), "{err}");
        let bytes = jpeg(&halves(64, 64, RED, BLUE), 90);
        let cut = &bytes[..bytes.len() / 2];
        let err = decode_bytes(cut, Path::new("leaf/cut.jpg"), options).unwrap_err();
        assert!(err.to_string().contains("leaf/cut.jpg"), "{decoder:?}: {err}");
    }
}

#[test]
fn geometry_helpers() {
    let mut image = halves(4, 2, RED, BLUE);
    image.flip_horizontal();
    assert_eq!(image.pixel(0, 0), BLUE);
    let resized = image.resize_short_side(4).unwrap();
    assert_eq!((resized.width(), resized.height()), (8, 4));
    assert!(RgbImage::new(2, 2, vec![0; 11]).is_err());
    assert!(image.clone().oriented(9).is_err());
    let turned = image.oriented(8).unwrap();
    assert_eq!((turned.width(), turned.height()), (2, 4));
}

#[test]
fn cmyk_reads_inverted_only_in_adobe_files() {
    let cyan_ink_adobe = [0, 255, 255, 255];
    assert_eq!(cmyk_to_rgb(&cyan_ink_adobe, true), [0, 255, 255]);
    let cyan_ink = [255, 0, 0, 0];
    assert_eq!(cmyk_to_rgb(&cyan_ink, false), [0, 255, 255]);
    assert_eq!(cmyk_to_rgb(&[0, 0, 0, 128], false), [127, 127, 127], "half black ink");
}
