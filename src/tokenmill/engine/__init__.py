"""The engine: requests, the KV block pool, the scheduler, the model runner and the step loop."""
