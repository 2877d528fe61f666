//! The work queue of a single controller: the runtime's scheduler keyed by
//! resource name (see [`crate::runtime::scheduler`]).

pub type WorkQueue = crate::runtime::scheduler::Scheduler<String>;
