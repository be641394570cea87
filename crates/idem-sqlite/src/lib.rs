//! Embedded SQLite store.
