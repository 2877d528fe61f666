//! Reconcilers.
