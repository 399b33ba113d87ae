"""The worker: the model, its KV pages, the connector's worker half and the model runner of one rank."""
