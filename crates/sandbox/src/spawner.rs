//! The spawner: the one thread of a sandboxed process that starts udrive's
//! threads. A new thread inherits its creator's filter; started here it inherits
//! only the control role's, which allows every other role's calls, and adds its
//! own. So no data-plane thread needs `clone`, and a role's list never has to
//! cover what the threads it asks for need.

use std::io;
use std::sync::OnceLock;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use crate::policy::Role;
use crate::Error;

type Job = Box<dyn FnOnce() + Send>;

static SPAWNER: OnceLock<Sender<Job>> = OnceLock::new();

pub(crate) fn start() -> Result<(), Error> {
    let (tx, rx) = crossbeam_channel::unbounded::<Job>();
    std::thread::Builder::new()
        .name("spawner".into())
        .spawn(move || {
            crate::enter_or_exit(Role::Control);
            for job in rx {
                job();
            }
        })
        .map_err(Error::Spawner)?;
    SPAWNER.set(tx).map_err(|_| Error::Configured)
}

/// Starts a thread named `name` that runs `f` under `role`'s filter (a plain
/// thread when the process has no sandbox).
pub fn spawn<F, T>(role: Role, name: String, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let builder = std::thread::Builder::new().name(name);
    let Some(spawner) = SPAWNER.get() else {
        return builder.spawn(f);
    };
    let body = move || {
        // What the spawner passed on.
        crate::sigsys::set_role(Role::Control);
        crate::enter_or_exit(role);
        #[cfg(feature = "forbidden-call-hook")]
        crate::hook::forbidden_call_if_asked();
        f()
    };
    let gone = || io::Error::other("the sandbox's spawner thread is gone");
    let (tx, rx) = crossbeam_channel::bounded(1);
    spawner
        .send(Box::new(move || {
            let _ = tx.send(builder.spawn(body));
        }))
        .map_err(|_| gone())?;
    rx.recv().map_err(|_| gone())?
}
