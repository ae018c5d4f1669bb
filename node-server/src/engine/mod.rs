//! Generation on top of the model: sampling and the decode loop.

pub mod sampling;
pub mod scheduler;
