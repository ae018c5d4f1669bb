//! Compute backends. `cpu` is the reference path every other backend is proved against.

pub mod cpu;
