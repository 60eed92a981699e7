"""Around the service: the CLI, the demo, benchmarks, the test redis-server."""
