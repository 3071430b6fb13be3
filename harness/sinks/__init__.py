"""Where results go: Parquet files, Weights & Biases runs, and the masking of secrets on the way."""
