//! Experiments on kvtier-io: fresh memory and the loader's staging ring.
//!
//! * [`first_touch`]: how fast fresh memory faults in, by one thread and by
//!   several, touched or populated.
//! * [`staged_vs_in_place`]: a model load staged through the ring against
//!   one straight into its final buffers.

pub mod first_touch;
pub mod staged_vs_in_place;
