//! A Keras-style batch-normalization layer (being written).
