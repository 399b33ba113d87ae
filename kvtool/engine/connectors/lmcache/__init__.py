"""The LMCache connector: cache keys and chunk hashes, the lm:// client, the connector halves."""
