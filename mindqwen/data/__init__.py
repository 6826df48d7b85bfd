"""Data: token arrays to fixed-shape, seeded, shardable, resumable batches."""
