//! Several rendered pieces as one bundle: HTML pieces concatenated, text
//! pieces separated by blank lines.

use super::{escape_html, Bundle};

#[derive(Debug, Default)]
pub struct Composer {
    text: Vec<String>,
    html: Vec<String>,
}

impl Composer {
    pub fn new() -> Self {
        Composer::default()
    }

    /// A line of prose, bold in HTML.
    pub fn headline(mut self, line: &str, color: &str) -> Self {
        self.text.push(line.to_owned());
        self.html.push(format!("<p style=\"font-weight:bold;color:{color}\">{}</p>", escape_html(line)));
        self
    }

    /// A line of prose that qualifies the headline, in italics in HTML.
    pub fn remark(mut self, line: &str) -> Self {
        self.text.push(line.to_owned());
        self.html.push(format!("<p style=\"font-style:italic\">{}</p>", escape_html(line)));
        self
    }

    /// A bundle's text and its richest HTML form.
    pub fn part(mut self, bundle: &Bundle) -> Self {
        self.text.push(bundle.text().trim_end().to_owned());
        self.push_html(bundle);
        self
    }

    /// A bundle shown in HTML only (a chart whose numbers a table already gives as text).
    pub fn html_only(mut self, bundle: &Bundle) -> Self {
        self.push_html(bundle);
        self
    }

    fn push_html(&mut self, bundle: &Bundle) {
        let as_str = |mime| bundle.get(mime).and_then(|v| v.as_str());
        let html = match (as_str("text/html"), as_str("image/svg+xml")) {
            (Some(html), _) => html.to_owned(),
            (None, Some(svg)) => format!("<div class=\"vramlab-chart\">{svg}</div>"),
            (None, None) => format!("<pre>{}</pre>", escape_html(bundle.text())),
        };
        self.html.push(html);
    }

    pub fn finish(self) -> Bundle {
        Bundle::plain(self.text.join("\n\n") + "\n")
            .with("text/html", format!("<div class=\"vramlab-report\">{}</div>", self.html.concat()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_text_and_html_and_inlines_svg() {
        let table = Bundle::plain("a table\n").with("text/html", "<table></table>");
        let chart = Bundle::plain("chart points").with("image/svg+xml", "<svg></svg>");
        let bundle = Composer::new().headline("FITS <really>", "green").part(&table).html_only(&chart).finish();
        assert_eq!(bundle.text(), "FITS <really>\n\na table\n");
        let html = bundle.get("text/html").unwrap().as_str().unwrap();
        assert!(html.contains("FITS &lt;really&gt;</p><table></table><div class=\"vramlab-chart\"><svg></svg></div>"), "{html}");
    }
}
