//! What a benchmark drives.
//!
//! * [`target`]: the choice: the in-process engine or an endpoint.
//! * [`inproc`]: kvtier's own engine and scheduler in this process.
//! * [`endpoint`]: an OpenAI-compatible endpoint (`kvtier serve`, vLLM,
//!   llama.cpp's server, ...), timed from the client's side.
//! * [`endpoint_pair`]: a baseline server and a kvtier server in one run.

pub mod target;

pub mod inproc;

pub mod endpoint;
pub mod endpoint_pair;
