//! Reading and writing tensors as NumPy `.npy` files (being written).
