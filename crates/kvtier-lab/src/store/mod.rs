//! Experiments on kvtier-store: codecs and G3.
//!
//! * [`codec_speed`]: each KV codec's coding and decoding of one block on
//!   one core, beside the plain copy.
//! * [`g3_reopen`]: G3's open after a kill -9, after a clean stop, and by a
//!   scan of every slot, at several sizes.
//! * [`g3_sync_bound`]: how long after a put a block is on G3 under the
//!   bounded write-back.

pub mod codec_speed;
pub mod g3_reopen;
pub mod g3_sync_bound;
