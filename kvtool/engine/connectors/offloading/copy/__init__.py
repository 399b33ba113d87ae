"""Moving KV between the pages and host memory: layer and pitched copies, transfer plans."""
