//! Generation on top of the model: sampling and the decode loop.

pub mod constraint;
pub mod sampling;
pub mod scheduler;
