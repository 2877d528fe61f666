//! In-memory store for simulation tests.
