//! One reader per trace format, each into [`crate::Trace`].

pub mod generic;
pub mod mooncake;
pub mod ragpulse;
pub mod tester;
