//! Generation on top of the model: sampling and the decode loop.

pub mod cache;
pub mod constraint;
pub mod sampling;
pub mod scheduler;
mod worker;
