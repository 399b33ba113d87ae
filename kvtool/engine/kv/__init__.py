"""The KV cache: pages, dtypes, sizes in blocks, and the identity stored KV is checked against."""
