//! A kernel whose front end has died exits, as ipykernel's parent poller does:
//! otherwise it keeps its build slot and half a gigabyte until someone kills it.

use std::time::Duration;

const POLL: Duration = Duration::from_millis(500);

/// Watches the parent process from a thread and exits once it is gone: we are
/// then handed to init or a subreaper, and our parent pid changes. (ipykernel
/// watches the pid in `JPY_PARENT_PID`, which is this same parent when Jupyter
/// starts the kernel.)
pub fn exit_when_orphaned() {
    let parent = std::os::unix::process::parent_id();
    if parent <= 1 {
        log::info!("started by init: no parent to watch");
        return;
    }
    let spawned = std::thread::Builder::new().name("parent-watch".into()).spawn(move || loop {
        std::thread::sleep(POLL);
        let now = std::os::unix::process::parent_id();
        if now != parent {
            log::warn!("the process that started this kernel ({parent}) has exited; the kernel exits too");
            // The cell process reads its commands from our pipe and exits when it closes.
            std::process::exit(1);
        }
    });
    if let Err(err) = spawned {
        log::warn!("cannot watch the parent process: {err}");
    }
}
