//! What made a hypervisor operation fail, kept as the error it was (an
//! `io::Error`, a `QmpError`, a JSON error, …) rather than flattened to
//! text: [`HvError`](crate::HvError) hands it out as its `source()`, so an
//! error chain prints it and a caller may downcast it.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A shared cause. `HvError` is `Clone` and `Eq` (domain listings and the
/// sim driver's scripted faults copy and compare errors), which
/// `io::Error` is not: the cause sits behind an `Arc`, and two causes are
/// equal when they read the same, sources included.
#[derive(Clone)]
pub struct Cause(Arc<dyn Error + Send + Sync + 'static>);

impl Cause {
    pub fn new(err: impl Error + Send + Sync + 'static) -> Self {
        Cause(Arc::new(err))
    }

    /// The error itself, to downcast.
    pub fn get(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.0
    }
}

/// `err` and its causes, outermost first, as one line: for the driver's
/// own reports, and keel-ctrl's `error_chain` above it.
pub fn with_causes(err: &(dyn Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

/// Reads as the error it holds.
impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// Transparent: the held error's own causes follow it in a chain.
impl Error for Cause {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || with_causes(self) == with_causes(other)
    }
}

impl Eq for Cause {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_reads_as_its_error_and_keeps_it() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "qmp.sock gone");
        let cause = Cause::new(io);
        assert_eq!(cause.to_string(), "qmp.sock gone");
        let back = cause.get().downcast_ref::<std::io::Error>().unwrap();
        assert_eq!(back.kind(), std::io::ErrorKind::NotFound);
        assert_eq!(cause.clone(), cause);
    }
}
