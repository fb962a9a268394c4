"""The local platform: pgherd on this machine, without Kubernetes (the sandbox and its helpers)."""
