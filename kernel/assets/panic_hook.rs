{
    let main_thread = std::thread::current().id();
    std::panic::set_hook(Box::new(move |info| {
        fn esc(s: &str) -> String {
            let mut out = String::with_capacity(s.len());
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                    c => out.push(c),
                }
            }
            out
        }
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(a panic payload that is not a string)".to_string());
        let location = info
            .location()
            .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
            .unwrap_or_default();
        let thread = std::thread::current();
        let backtrace = std::backtrace::Backtrace::force_capture().to_string();
        println!(
            "\u{1e}vramlab:panic {{\"thread\":\"{}\",\"cell_thread\":{},\"message\":\"{}\",\"location\":\"{}\",\"backtrace\":\"{}\"}}",
            esc(thread.name().unwrap_or("<unnamed>")),
            thread.id() == main_thread,
            esc(&message),
            esc(&location),
            esc(&backtrace)
        );
    }));
}
