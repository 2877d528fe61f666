//! Errors as operators read them: one line with every cause.

/// `err` and its causes, outermost first, as one line. The driver's own
/// reports use the same function, so both layers print a chain alike.
pub use keel_hv::cause::with_causes as error_chain;
