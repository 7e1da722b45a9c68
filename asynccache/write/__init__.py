"""Writing a dataset: the chunk writer and merge, the write lock, upload."""
