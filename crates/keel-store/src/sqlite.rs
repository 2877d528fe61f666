//! Filled in by the SQLite work.
