"""The Kubernetes adapter: builders, observation, and the operator in-process against a real API server."""
