"""The Kubernetes adapter: builders, the emulated API server, the operator in-process."""
