//! Text in and out, as `transformers` does it.
//!
//! * [`tokenizer`]: text <-> tokens, with the special tokens the model adds.
//! * [`chat_template`]: the model's own Jinja chat template, rendered.

pub mod tokenizer;

pub mod chat_template;
